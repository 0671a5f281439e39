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

/// What data structures and applications need of a transaction, whether it blocks ([`Txn`], in
/// `txn(|tx| ..)`) or waits by yielding to the other transactions of its thread
/// ([`crate::AsyncTxn`], in [`crate::Pipeline::txn`]). Code written once as `async fn`s over it
/// runs in both: with a [`Txn`] every call is ready at once, and [`ready`] runs it.
#[allow(async_fn_in_trait)] // Futures of one thread's executor: never sent across threads.
pub trait Transaction {
    /// Reads the first `len` bytes of the object at `addr` and gives them to `f`: the
    /// transaction's own write if there is one, else a consistent read at the primary.
    async fn read_with<R>(
        &mut self,
        addr: Addr,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TxError>;

    /// Reads the object at `addr` as a `T`.
    async fn read<T: Pod>(&mut self, addr: Addr) -> Result<T, TxError> {
        self.read_with(addr, std::mem::size_of::<T>(), bytemuck::pod_read_unaligned)
            .await
    }

    /// A hint that the first `len` bytes of the object at `addr` will be read soon (see
    /// [`Txn::prefetch`]).
    fn prefetch(&mut self, addr: Addr, len: usize);

    /// Writes `data` to the object at `addr` at commit (it must fit the object's slot).
    async fn write_bytes(&mut self, addr: Addr, data: &[u8]) -> Result<(), TxError>;

    /// Writes `value` to the object at `addr` at commit.
    async fn write<T: Pod>(&mut self, addr: Addr, value: &T) -> Result<(), TxError> {
        self.write_bytes(addr, bytemuck::bytes_of(value)).await
    }

    /// Allocates an object holding `data` (see [`Txn::alloc`]).
    fn alloc_bytes(&mut self, data: &[u8], near: Option<Addr>) -> Result<Addr, TxError>;

    /// Allocates an object holding `value` (see [`Txn::alloc`]).
    fn alloc<T: Pod>(&mut self, value: &T, near: Option<Addr>) -> Result<Addr, TxError> {
        self.alloc_bytes(bytemuck::bytes_of(value), near)
    }

    /// Frees the object at `addr` at commit.
    async fn free(&mut self, addr: Addr) -> Result<(), TxError>;

    /// An error that aborts the transaction with `reason`; return it from the closure.
    fn abort(&self, reason: impl Into<String>) -> TxError {
        TxError::Aborted(reason.into())
    }
}

impl Transaction for Txn<'_> {
    async fn read_with<R>(
        &mut self,
        addr: Addr,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TxError> {
        self.inner.read(addr, len).map(f)
    }

    fn prefetch(&mut self, addr: Addr, len: usize) {
        Txn::prefetch(self, addr, len)
    }

    async fn write_bytes(&mut self, addr: Addr, data: &[u8]) -> Result<(), TxError> {
        Txn::write_bytes(self, addr, data)
    }

    fn alloc_bytes(&mut self, data: &[u8], near: Option<Addr>) -> Result<Addr, TxError> {
        Txn::alloc_bytes(self, data, near)
    }

    async fn free(&mut self, addr: Addr) -> Result<(), TxError> {
        Txn::free(self, addr)
    }
}

/// The value of `f`, a future that completes on its first poll: code written over
/// [`Transaction`] run with a blocking [`Txn`], whose calls never wait.
///
/// # Panics
///
/// If `f` waits (it awaited something other than a [`Txn`]'s calls).
pub fn ready<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("a blocking transaction's code waited"),
    }
}
