//! The typed transaction handle given to `txn()` closures.

use bytemuck::Pod;
use farm_core::Addr;
use farm_txn::{Tx, TxError, TxState};

/// A transaction in execution. Reads return committed, consistent objects and see this
/// transaction's own writes; writes, allocations and frees take effect at commit.
#[derive(Debug)]
pub struct Txn<'w> {
    inner: Tx<'w>,
    /// Where allocations without a hint go (see `Node`'s `Client::txn`).
    place: Option<Addr>,
}

impl<'w> Txn<'w> {
    /// A transaction whose allocations without a locality hint go near `place`.
    pub(crate) fn placed(inner: Tx<'w>, place: Option<Addr>) -> Self {
        Self { inner, place }
    }

    pub(crate) fn into_state(self) -> TxState {
        self.inner.into_state()
    }

    /// Reads the object at `addr` as a `T`.
    pub fn read<T: Pod>(&mut self, addr: Addr) -> Result<T, TxError> {
        let bytes = self.inner.read(addr, std::mem::size_of::<T>())?;
        Ok(bytemuck::pod_read_unaligned(bytes))
    }

    /// Writes `value` to the object at `addr` at commit.
    pub fn write<T: Pod>(&mut self, addr: Addr, value: &T) -> Result<(), TxError> {
        self.inner.write(addr, bytemuck::bytes_of(value))
    }

    /// Allocates an object holding `value`, in the region of `near` when this machine is its
    /// primary (a locality hint), else in a region this machine is primary for.
    pub fn alloc<T: Pod>(&mut self, value: &T, near: Option<Addr>) -> Result<Addr, TxError> {
        let addr = self
            .inner
            .alloc(std::mem::size_of::<T>(), near.or(self.place))?;
        self.inner.write(addr, bytemuck::bytes_of(value))?;
        Ok(addr)
    }

    /// Reads the first `len` bytes of the object at `addr` (for objects whose layout is not a
    /// Rust type, such as a data structure's nodes).
    pub fn read_bytes(&mut self, addr: Addr, len: usize) -> Result<&[u8], TxError> {
        self.inner.read(addr, len)
    }

    /// A hint that the first `len` bytes of the object at `addr` will be read soon: its bytes
    /// start on their way without waiting, so that a transaction which knows the addresses of
    /// several reads ahead overlaps their fetches, as FaRM's applications issue reads in
    /// parallel (§4). Changes nothing the transaction reads.
    pub fn prefetch(&mut self, addr: Addr, len: usize) {
        self.inner.prefetch(addr, len)
    }

    /// Writes `data` to the object at `addr` at commit (it must fit the object's slot).
    pub fn write_bytes(&mut self, addr: Addr, data: &[u8]) -> Result<(), TxError> {
        self.inner.write(addr, data)
    }

    /// Allocates an object holding `data`, placed as [`Txn::alloc`] places it.
    pub fn alloc_bytes(&mut self, data: &[u8], near: Option<Addr>) -> Result<Addr, TxError> {
        let addr = self.inner.alloc(data.len(), near.or(self.place))?;
        self.inner.write(addr, data)?;
        Ok(addr)
    }

    /// Allocates `n` objects holding `data`, placed as [`Txn::alloc`] places them; on another
    /// machine, with every request sent before any answer is awaited.
    pub fn alloc_bytes_many(
        &mut self,
        data: &[u8],
        n: usize,
        near: Option<Addr>,
    ) -> Result<Vec<Addr>, TxError> {
        let addrs = self.inner.alloc_many(data.len(), n, near.or(self.place))?;
        for a in &addrs {
            self.inner.write(*a, data)?;
        }
        Ok(addrs)
    }

    /// Frees the object at `addr` at commit.
    pub fn free(&mut self, addr: Addr) -> Result<(), TxError> {
        self.inner.free(addr)
    }

    /// An error that aborts the transaction with `reason`; return it from the closure.
    pub fn abort(&self, reason: impl Into<String>) -> TxError {
        TxError::Aborted(reason.into())
    }
}
