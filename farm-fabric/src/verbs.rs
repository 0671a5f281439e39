//! The queue-pair layer of the `verbs` backend, for real RDMA hardware (cargo feature `verbs`;
//! docs/ARCHITECTURE.md, Fabric): an RDMA device opened through libibverbs, memory registered
//! with it, and reliable-connected queue pairs that post one-sided READs and WRITEs in batches
//! (one doorbell per batch) and report their completions to a poll, the shape the `Fabric`
//! contract's posted work and completions follow.
//!
//! This is the layer a `verbs` fabric is built on; the fabric itself (queue pairs per peer
//! thread pair, registration of regions and rings, UD for leases and control datagrams, the
//! exchange of queue-pair addresses at connection) is not written yet. The `sideway` crate
//! loads libibverbs when the process starts, so this builds where no RDMA library is
//! installed; [`Device::open`] says why it found no device instead of failing.

use std::fmt;
use std::io;
use std::sync::Arc;

use farm_core::nvram::Nvram;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    ExtendedCompletionQueue, GenericCompletionQueue, PollCompletionQueueError, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, PostSendGuard, QueuePair as _, QueuePairAttribute, QueuePairState,
    QueuePairType, SendOperationFlags, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

/// The port every queue pair uses (the first; multi-port devices are not chosen between).
const PORT: u8 = 1;
/// The GID table entry used for the global route header (RoCE needs one).
const GID_INDEX: u8 = 0;
/// RDMA READs a queue pair keeps outstanding, as initiator and as target.
const READS_OUTSTANDING: u8 = 16;

/// A verbs call that failed, with what was being done.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {why}")]
pub struct VerbsError {
    what: &'static str,
    why: String,
}

fn failed<E: fmt::Display>(what: &'static str) -> impl FnOnce(E) -> VerbsError {
    move |e| VerbsError {
        what,
        why: e.to_string(),
    }
}

/// An RDMA device opened for use: its context, one protection domain, and the port's address.
pub struct Device {
    name: String,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    lid: u16,
    gid: Gid,
    mtu: Mtu,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("lid", &self.lid)
            .finish_non_exhaustive()
    }
}

impl Device {
    /// Opens the first RDMA device: `Ok(Err(why))` if there is none (no libibverbs, no kernel
    /// support, or no device), which is not a failure on a machine without RDMA.
    pub fn open() -> Result<Result<Self, String>, VerbsError> {
        let list = match DeviceList::new() {
            Ok(list) => list,
            // EOPNOTSUPP: libibverbs.so.1 could not be loaded; ENOSYS: the kernel has no RDMA
            // support.
            Err(e) => match e.0 {
                GetDeviceListErrorKind::Ibverbs(io) if io.kind() == io::ErrorKind::Unsupported => {
                    return Ok(Err(format!(
                        "no RDMA support here (libibverbs or the kernel's verbs: {io})"
                    )))
                }
                other => return Err(failed("listing RDMA devices")(format!("{other:?}"))),
            },
        };
        let Some(device) = list.get(0) else {
            return Ok(Err("no RDMA device".into()));
        };
        let name = device.name();
        let ctx = device.open().map_err(failed("opening the RDMA device"))?;
        let port = ctx
            .query_port(PORT)
            .map_err(failed("querying the RDMA port"))?;
        let gid = ctx
            .query_gid(PORT, GID_INDEX.into())
            .map_err(failed("querying the RDMA port's GID"))?;
        let pd = ctx
            .alloc_pd()
            .map_err(failed("allocating a protection domain"))?;
        Ok(Ok(Self {
            name,
            lid: port.lid(),
            mtu: port.active_mtu(),
            gid,
            ctx,
            pd,
        }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers `mem` with the device for local access and peers' one-sided READs and
    /// WRITEs: the registration keeps `mem` mapped for as long as it lives.
    pub fn register(&self, mem: Arc<Nvram>) -> Result<Registered, VerbsError> {
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteRead | AccessFlags::RemoteWrite;
        // SAFETY: the range is `mem`'s whole mapping, which the returned registration keeps
        // alive (it holds `mem`) for as long as the device may touch it.
        let mr = unsafe { self.pd.reg_mr(mem.as_ptr() as usize, mem.len(), access) }
            .map_err(failed("registering memory"))?;
        Ok(Registered { mr, mem })
    }

    /// A reliable-connected queue pair with room for `depth` outstanding work requests and a
    /// completion queue of its own; connect it with [`QueuePair::connect`].
    pub fn queue_pair(&self, depth: u32) -> Result<QueuePair, VerbsError> {
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(depth)
            .build_ex()
            .map_err(failed("creating a completion queue"))?;
        let qp = self
            .pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(depth)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_ops_flags(SendOperationFlags::Write | SendOperationFlags::Read)
            .setup_send_cq(GenericCompletionQueue::from(cq.clone()))
            .setup_recv_cq(GenericCompletionQueue::from(cq.clone()))
            .build_ex()
            .map_err(failed("creating a queue pair"))?
            .into();
        let psn = u32::from_le_bytes(crate::auth::nonce()[..4].try_into().expect("4 bytes"))
            & 0x00ff_ffff;
        Ok(QueuePair {
            qp,
            cq,
            psn,
            lid: self.lid,
            gid: self.gid,
            mtu: self.mtu,
        })
    }
}

/// Memory registered with a device: what peers need to address it ([`Registered::remote`]),
/// and the local key its own work requests use.
pub struct Registered {
    mr: Arc<MemoryRegion>,
    mem: Arc<Nvram>,
}

impl fmt::Debug for Registered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered")
            .field("len", &self.mem.len())
            .finish_non_exhaustive()
    }
}

impl Registered {
    /// Where a peer's one-sided operations find this memory.
    pub fn remote(&self) -> RemoteArea {
        RemoteArea {
            addr: self.mem.as_ptr() as u64,
            len: self.mem.len(),
            rkey: self.mr.rkey(),
        }
    }

    /// `len` bytes at `offset` of this memory, as the local side of a work request.
    pub fn local(&self, offset: usize, len: usize) -> LocalSlice {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.mem.len()),
            "{offset}+{len} outside the {} registered bytes",
            self.mem.len()
        );
        LocalSlice {
            addr: self.mem.as_ptr() as u64 + offset as u64,
            len: len as u32,
            lkey: self.mr.lkey(),
        }
    }
}

/// A registered area as a peer addresses it (exchanged out of band).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteArea {
    /// The area's first byte in its owner's address space.
    pub addr: u64,
    /// Its length in bytes.
    pub len: usize,
    /// The key peers' operations carry.
    pub rkey: u32,
}

/// The local side of a work request.
#[derive(Clone, Copy, Debug)]
pub struct LocalSlice {
    addr: u64,
    len: u32,
    lkey: u32,
}

/// What a peer needs to connect its queue pair to this one (exchanged out of band).
#[derive(Clone, Copy, Debug)]
pub struct Address {
    /// The queue pair's number.
    pub qpn: u32,
    /// Its first packet sequence number.
    pub psn: u32,
    /// The port's local identifier (InfiniBand).
    pub lid: u16,
    /// The port's global identifier (RoCE, routed InfiniBand).
    pub gid: [u8; 16],
}

/// A one-sided operation to post.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// Copies the remote bytes into the local slice.
    Read,
    /// Copies the local slice to the remote bytes.
    Write,
}

/// One work request of a batch: `op` between `local` and the remote area at `offset`.
#[derive(Clone, Copy, Debug)]
pub struct WorkRequest {
    /// The id its completion carries.
    pub id: u64,
    /// Read or write.
    pub op: Op,
    /// The local side.
    pub local: LocalSlice,
    /// The remote area.
    pub remote: RemoteArea,
    /// Where in the remote area.
    pub offset: u64,
    /// Whether it completes with a completion of its own (an unsignaled one is complete once
    /// a later signaled one of the same queue pair is: they finish in order).
    pub signaled: bool,
}

/// A completed work request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub id: u64,
    /// `Err` with the device's status if it failed (the queue pair is then in the error
    /// state, and every later request of it fails too).
    pub status: Result<(), String>,
}

/// A reliable-connected queue pair and its completion queue.
pub struct QueuePair {
    qp: GenericQueuePair,
    cq: Arc<ExtendedCompletionQueue>,
    psn: u32,
    /// The device port's address and path MTU.
    lid: u16,
    gid: Gid,
    mtu: Mtu,
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.qp.qp_number())
            .finish_non_exhaustive()
    }
}

impl QueuePair {
    /// What the peer's queue pair connects to.
    pub fn address(&self) -> Address {
        Address {
            qpn: self.qp.qp_number(),
            psn: self.psn,
            lid: self.lid,
            gid: self.gid.raw,
        }
    }

    /// Connects to the peer queue pair at `remote`: INIT, ready to receive, ready to send.
    pub fn connect(&mut self, remote: &Address) -> Result<(), VerbsError> {
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteRead | AccessFlags::RemoteWrite;
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(PORT)
            .setup_access_flags(access);
        self.qp
            .modify(&init)
            .map_err(failed("moving a queue pair to INIT"))?;
        let mut path = AddressHandleAttribute::new();
        path.setup_dest_lid(remote.lid)
            .setup_port(PORT)
            .setup_service_level(0)
            .setup_grh_src_gid_index(GID_INDEX)
            .setup_grh_dest_gid(&Gid { raw: remote.gid })
            .setup_grh_hop_limit(64);
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(self.mtu)
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(READS_OUTSTANDING)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&path);
        self.qp
            .modify(&rtr)
            .map_err(failed("moving a queue pair to RTR"))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(READS_OUTSTANDING);
        self.qp
            .modify(&rts)
            .map_err(failed("moving a queue pair to RTS"))
    }

    /// Posts `batch` in order, with one doorbell.
    pub fn post(&mut self, batch: &[WorkRequest]) -> Result<(), VerbsError> {
        let mut guard = self.qp.start_post_send();
        for w in batch {
            let flags = if w.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            assert!(
                (w.offset.checked_add(w.local.len.into()))
                    .is_some_and(|end| end <= w.remote.len as u64),
                "a work request past the remote area"
            );
            let wr = guard.construct_wr(w.id, flags);
            let remote = w.remote.addr + w.offset;
            let wr = match w.op {
                Op::Read => wr.setup_read(w.remote.rkey, remote),
                Op::Write => wr.setup_write(w.remote.rkey, remote),
            };
            // SAFETY: the local slice lies inside a registration (`Registered::local`), which
            // the caller keeps until the request completes.
            unsafe { wr.setup_sge(w.local.lkey, w.local.addr, w.local.len) };
        }
        guard.post().map_err(failed("posting work requests"))
    }

    /// Appends the completions that arrived to `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        let poller = match self.cq.start_poll() {
            Ok(poller) => poller,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(0),
            Err(e) => return Err(failed("polling a completion queue")(e)),
        };
        let before = out.len();
        for wc in poller {
            let status = if wc.status() == WorkCompletionStatus::Success as u32 {
                Ok(())
            } else {
                Err(format!(
                    "status {} (vendor error {})",
                    wc.status(),
                    wc.vendor_err()
                ))
            };
            out.push(Completion {
                id: wc.wr_id(),
                status,
            });
        }
        Ok(out.len() - before)
    }
}
