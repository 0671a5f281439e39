//! Newtype identifiers and global addresses (FaRM §3, §4).
//!
//! Every id has an explicit width because ids go on the wire and into NVRAM.

use std::fmt;

/// A machine of the cluster.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct MachineId(pub u16);

/// A worker thread index inside a machine. Worker `t` of one machine talks to worker `t` of every
/// other machine ("peer threads").
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct ThreadId(pub u16);

/// A 2 GB (by default) region of the global address space; ids come from the CM's counter (§3).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct RegionId(pub u32);

/// A configuration identifier: unique and monotonically increasing (§3).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct ConfigId(pub u64);

/// An object version, kept in the object header (§3).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct Version(pub u64);

/// Transaction id `<c, m, t, l>` (§5.3): the configuration when commit started, the coordinator
/// machine and thread, and a counter local to that thread.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct TxnId {
    /// Configuration in force when the commit started.
    pub config: ConfigId,
    /// Coordinator machine.
    pub machine: MachineId,
    /// Coordinator thread.
    pub thread: ThreadId,
    /// Counter local to the coordinator thread, increasing.
    pub local: u64,
}

impl fmt::Display for TxnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "<{},{},{},{}>",
            self.config.0, self.machine.0, self.thread.0, self.local
        )
    }
}

/// A global address: a region and a byte offset in it. The object header is at `offset`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct Addr {
    /// The region holding the object.
    pub region: RegionId,
    /// Byte offset of the object header inside the region.
    pub offset: u32,
}

impl Addr {
    /// An address from its parts.
    pub const fn new(region: RegionId, offset: u32) -> Self {
        Self { region, offset }
    }

    /// The address packed into one word (region in the high half), for compact keys.
    pub const fn to_u64(self) -> u64 {
        ((self.region.0 as u64) << 32) | self.offset as u64
    }

    /// The inverse of [`Addr::to_u64`].
    pub const fn from_u64(word: u64) -> Self {
        Self {
            region: RegionId((word >> 32) as u32),
            offset: word as u32,
        }
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}+{:#x}", self.region.0, self.offset)
    }
}

impl fmt::Display for MachineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "m{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_packs_and_unpacks() {
        let a = Addr::new(RegionId(0xdead_beef), 0x1234_5678);
        assert_eq!(Addr::from_u64(a.to_u64()), a);
        assert_eq!(a.to_string(), "r3735928559+0x12345678");
    }

    #[test]
    fn txn_ids_order_by_config_first() {
        let a = TxnId {
            config: ConfigId(1),
            machine: MachineId(9),
            thread: ThreadId(9),
            local: 9,
        };
        let b = TxnId {
            config: ConfigId(2),
            machine: MachineId(0),
            thread: ThreadId(0),
            local: 0,
        };
        assert!(a < b);
    }
}
