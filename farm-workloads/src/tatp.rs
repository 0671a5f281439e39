//! TATP (Telecom Application Transaction Processing, version 1.0), as FaRM runs it (§6): its
//! four tables as [`farm_ds::HashTable`]s and its seven transactions in the standard mix, with
//! the single-row lookups (70% of the mix) as lock-free reads.
//!
//! Tables, keyed as the specification's primary keys:
//! - SUBSCRIBER by `s_id`, and an index from `sub_nbr` (the 15-digit string of `s_id`) to
//!   `s_id` for the transactions that name a subscriber by number;
//! - ACCESS_INFO by `(s_id, ai_type)`, 1 to 4 per subscriber;
//! - SPECIAL_FACILITY by `(s_id, sf_type)`, 1 to 4 per subscriber, 85% active;
//! - CALL_FORWARDING by `(s_id, sf_type, start_time)`, 0 to 3 per special facility, start
//!   times 0, 8 or 16.
//!
//! Every table is partitioned by `s_id` over the machines (the index by its own hash). As in
//! the paper, clients do not partition: a transaction runs on a random machine unless asked to
//! run where its subscriber lives.

use bytemuck::{Pod, Zeroable};

use farm::{ready, Addr, Client, MachineId, Pipeline, Transaction, TxError};
use farm_ds::{HashTable, TableSpec};

use crate::{Blocking, LockFree, Rand};

/// SUBSCRIBER's non-key columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Subscriber {
    /// `sub_nbr`: `s_id` as 15 decimal digits (and a zero byte).
    pub sub_nbr: [u8; 16],
    /// `msc_location`.
    pub msc_location: u32,
    /// `vlr_location`.
    pub vlr_location: u32,
    /// `bit_1` to `bit_10`, one bit each.
    pub bits: u16,
    /// `byte2_1` to `byte2_10`.
    pub byte2: [u8; 10],
    /// `hex_1` to `hex_10`, four bits each (and padding).
    pub hex: [u8; 8],
}

/// ACCESS_INFO's non-key columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct AccessInfo {
    /// `data1`.
    pub data1: u8,
    /// `data2`.
    pub data2: u8,
    /// `data3`: 3 characters.
    pub data3: [u8; 3],
    /// `data4`: 5 characters.
    pub data4: [u8; 5],
}

/// SPECIAL_FACILITY's non-key columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct SpecialFacility {
    /// `is_active`: 1 for 85% of the rows.
    pub is_active: u8,
    /// `error_cntrl`.
    pub error_cntrl: u8,
    /// `data_a`.
    pub data_a: u8,
    /// `data_b`: 5 characters.
    pub data_b: [u8; 5],
}

/// CALL_FORWARDING's non-key columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct CallForwarding {
    /// `end_time`: `start_time` plus 1 to 8.
    pub end_time: u8,
    /// `numberx`: 15 digits.
    pub numberx: [u8; 15],
}

/// The seven transactions, in the order of the mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// GET_SUBSCRIBER_DATA: one subscriber row (lock-free).
    GetSubscriberData,
    /// GET_NEW_DESTINATION: a special facility and its call forwardings (read-only).
    GetNewDestination,
    /// GET_ACCESS_DATA: one access-info row (lock-free).
    GetAccessData,
    /// UPDATE_SUBSCRIBER_DATA: a subscriber bit and a special facility's `data_a`.
    UpdateSubscriberData,
    /// UPDATE_LOCATION: a subscriber's `vlr_location`, by `sub_nbr`.
    UpdateLocation,
    /// INSERT_CALL_FORWARDING: by `sub_nbr`.
    InsertCallForwarding,
    /// DELETE_CALL_FORWARDING: by `sub_nbr`.
    DeleteCallForwarding,
}

impl Kind {
    /// All kinds, in mix order.
    pub const ALL: [Kind; 7] = [
        Kind::GetSubscriberData,
        Kind::GetNewDestination,
        Kind::GetAccessData,
        Kind::UpdateSubscriberData,
        Kind::UpdateLocation,
        Kind::InsertCallForwarding,
        Kind::DeleteCallForwarding,
    ];

    /// The standard mix, in percent.
    pub const fn percent(self) -> u64 {
        match self {
            Kind::GetSubscriberData => 35,
            Kind::GetNewDestination => 10,
            Kind::GetAccessData => 35,
            Kind::UpdateSubscriberData => 2,
            Kind::UpdateLocation => 14,
            Kind::InsertCallForwarding => 2,
            Kind::DeleteCallForwarding => 2,
        }
    }

    /// The specification's name.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::GetSubscriberData => "GET_SUBSCRIBER_DATA",
            Kind::GetNewDestination => "GET_NEW_DESTINATION",
            Kind::GetAccessData => "GET_ACCESS_DATA",
            Kind::UpdateSubscriberData => "UPDATE_SUBSCRIBER_DATA",
            Kind::UpdateLocation => "UPDATE_LOCATION",
            Kind::InsertCallForwarding => "INSERT_CALL_FORWARDING",
            Kind::DeleteCallForwarding => "DELETE_CALL_FORWARDING",
        }
    }

    /// The kind a uniform draw below 100 picks.
    pub fn from_draw(draw: u64) -> Kind {
        let mut acc = 0;
        for k in Kind::ALL {
            acc += k.percent();
            if draw < acc {
                return k;
            }
        }
        unreachable!("the mix adds up to 100")
    }
}

/// The tables of one TATP database.
#[derive(Clone, Debug)]
pub struct Tables {
    /// Subscribers: `s_id` 1 to this.
    pub subscribers: u32,
    /// SUBSCRIBER.
    pub subscriber: HashTable<u32, Subscriber>,
    /// `sub_nbr` to `s_id`.
    pub sub_nbr: HashTable<[u8; 16], u32>,
    /// ACCESS_INFO, keyed by [`ai_key`].
    pub access_info: HashTable<u64, AccessInfo>,
    /// SPECIAL_FACILITY, keyed by [`sf_key`].
    pub special_facility: HashTable<u64, SpecialFacility>,
    /// CALL_FORWARDING, keyed by [`cf_key`].
    pub call_forwarding: HashTable<u64, CallForwarding>,
}

/// ACCESS_INFO's key.
pub fn ai_key(s_id: u32, ai_type: u8) -> u64 {
    (s_id as u64) << 8 | ai_type as u64
}

/// SPECIAL_FACILITY's key.
pub fn sf_key(s_id: u32, sf_type: u8) -> u64 {
    (s_id as u64) << 8 | sf_type as u64
}

/// CALL_FORWARDING's key.
pub fn cf_key(s_id: u32, sf_type: u8, start_time: u8) -> u64 {
    (s_id as u64) << 16 | (sf_type as u64) << 8 | start_time as u64
}

/// `sub_nbr` of `s_id`: 15 decimal digits.
pub fn sub_nbr(s_id: u32) -> [u8; 16] {
    let mut out = [0u8; 16];
    let digits = format!("{s_id:015}");
    out[..15].copy_from_slice(digits.as_bytes());
    out
}

/// The specification's non-uniform subscriber id (clause 4.2): `(rand(0, A) | rand(1, P)) % P
/// + 1`, with A = 65535 up to 1 M subscribers, 1048575 up to 10 M, 2097151 beyond.
pub fn s_id(rng: &mut Rand, subscribers: u32) -> u32 {
    let p = subscribers as u64;
    let a = match p {
        0..=1_000_000 => 65_535,
        1_000_001..=10_000_000 => 1_048_575,
        _ => 2_097_151,
    };
    ((rng.range(0, a) | rng.range(1, p)) % p + 1) as u32
}

/// Where subscriber `s_id`'s rows live.
pub fn partition_of_s_id(s_id: u32, machines: usize) -> usize {
    s_id as usize % machines
}

impl Tables {
    /// Creates empty tables for `subscribers` over every machine of `cluster`.
    pub fn create(cluster: &impl Client, subscribers: u32) -> Result<Self, TxError> {
        let machines: Vec<MachineId> = (0..cluster.machines()).map(MachineId).collect();
        let n = machines.len();
        let spec = |rows_per_subscriber: u64, slots: u8| {
            TableSpec::with_capacity(
                machines.clone(),
                subscribers as u64 * rows_per_subscriber,
                slots,
            )
        };
        Ok(Self {
            subscribers,
            subscriber: HashTable::create(cluster, &spec(1, 4))?,
            sub_nbr: HashTable::create(cluster, &spec(1, 8))?,
            access_info: HashTable::create(cluster, &spec(4, 8))?,
            special_facility: HashTable::create(cluster, &spec(4, 8))?,
            // Up to 3 per special facility; the insert and delete transactions keep the count
            // near its start.
            call_forwarding: HashTable::create(cluster, &spec(6, 8))?,
        }
        .partitioned(n))
    }

    /// The tables' roots, from which [`Tables::open`] opens them elsewhere (another process).
    pub fn roots(&self) -> [Addr; 5] {
        [
            self.subscriber.root(),
            self.sub_nbr.root(),
            self.access_info.root(),
            self.special_facility.root(),
            self.call_forwarding.root(),
        ]
    }

    /// Opens the tables that [`Tables::create`] made for `subscribers`, from their
    /// [`Tables::roots`], reading through `machine`.
    pub fn open(
        cluster: &impl Client,
        machine: MachineId,
        subscribers: u32,
        roots: [Addr; 5],
    ) -> Result<Self, TxError> {
        let [subscriber, sub_nbr, access_info, special_facility, call_forwarding] = roots;
        Ok(Self {
            subscribers,
            subscriber: HashTable::open(cluster, machine, subscriber)?,
            sub_nbr: HashTable::open(cluster, machine, sub_nbr)?,
            access_info: HashTable::open(cluster, machine, access_info)?,
            special_facility: HashTable::open(cluster, machine, special_facility)?,
            call_forwarding: HashTable::open(cluster, machine, call_forwarding)?,
        }
        .partitioned(cluster.machines() as usize))
    }

    /// Keys partitioned by subscriber over `machines`: a subscriber's rows live on its machine.
    fn partitioned(self, machines: usize) -> Self {
        let by_s_id = move |s: u64| partition_of_s_id(s as u32, machines);
        Self {
            subscriber: self
                .subscriber
                .with_partitioner(move |s: &u32| by_s_id(*s as u64)),
            access_info: self
                .access_info
                .with_partitioner(move |k: &u64| by_s_id(k >> 8)),
            special_facility: self
                .special_facility
                .with_partitioner(move |k: &u64| by_s_id(k >> 8)),
            call_forwarding: self
                .call_forwarding
                .with_partitioner(move |k: &u64| by_s_id(k >> 16)),
            ..self
        }
    }

    /// Loads the subscribers of `partition` (clause 4.3), in transactions of `batch`
    /// subscribers coordinated on the partition's machine, calling `progress` with the number
    /// loaded after each. Rows depend only on `seed` and the subscriber.
    pub fn populate_partition(
        &self,
        cluster: &impl Client,
        partition: usize,
        batch: usize,
        seed: u64,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), TxError> {
        let machines = cluster.machines() as usize;
        let ids: Vec<u32> = (1..=self.subscribers)
            .filter(|id| partition_of_s_id(*id, machines) == partition)
            .collect();
        for chunk in ids.chunks(batch.max(1)) {
            cluster.txn(MachineId(partition as u16), |tx| {
                for &id in chunk {
                    let mut rng = Rand::new(seed ^ (id as u64) << 20);
                    self.insert_subscriber(tx, id, &mut rng)?;
                }
                Ok(())
            })?;
            progress(chunk.len() as u64);
        }
        Ok(())
    }

    fn insert_subscriber(
        &self,
        tx: &mut farm::Txn<'_>,
        id: u32,
        rng: &mut Rand,
    ) -> Result<(), TxError> {
        let mut hex = [0u8; 8];
        for b in hex.iter_mut().take(5) {
            *b = rng.next_u64() as u8;
        }
        let row = Subscriber {
            sub_nbr: sub_nbr(id),
            msc_location: rng.next_u64() as u32,
            vlr_location: rng.next_u64() as u32,
            bits: (rng.next_u64() & 0x3ff) as u16,
            byte2: std::array::from_fn(|_| rng.next_u64() as u8),
            hex,
        };
        self.subscriber.insert(tx, &id, &row)?;
        self.sub_nbr.insert(tx, &sub_nbr(id), &id)?;
        for ai_type in pick_types(rng) {
            let ai = AccessInfo {
                data1: rng.next_u64() as u8,
                data2: rng.next_u64() as u8,
                data3: rng.letters(),
                data4: rng.letters(),
            };
            self.access_info.insert(tx, &ai_key(id, ai_type), &ai)?;
        }
        for sf_type in pick_types(rng) {
            let sf = SpecialFacility {
                is_active: (rng.range(1, 100) <= 85) as u8,
                error_cntrl: rng.next_u64() as u8,
                data_a: rng.next_u64() as u8,
                data_b: rng.letters(),
            };
            self.special_facility
                .insert(tx, &sf_key(id, sf_type), &sf)?;
            // 0 to 3 call forwardings, at distinct start times.
            let mut starts = [0u8, 8, 16];
            for i in 0..3 {
                let j = i + (rng.next_u64() % (3 - i) as u64) as usize;
                starts.swap(i, j);
            }
            let n = rng.range(0, 3) as usize;
            for start in starts.into_iter().take(n) {
                let cf = CallForwarding {
                    end_time: start + rng.range(1, 8) as u8,
                    numberx: rng.digits(),
                };
                self.call_forwarding
                    .insert(tx, &cf_key(id, sf_type, start), &cf)?;
            }
        }
        Ok(())
    }

    /// Runs one transaction of `kind` with the specification's inputs, coordinated on `m`
    /// (`None`: on the subscriber's machine). Returns whether it succeeded in the
    /// specification's sense (found its rows, or inserted or deleted one), and adds the
    /// transaction's executions to `attempts` (more than one when conflicts made it retry).
    /// Blocks the thread until it ends; [`Tables::run_in`] runs it among others in flight.
    pub fn run(
        &self,
        cluster: &impl Client,
        m: Option<MachineId>,
        kind: Kind,
        rng: &mut Rand,
        attempts: &mut u64,
    ) -> Result<bool, TxError> {
        let (m, inputs) = self.inputs(cluster.machines(), m, kind, rng);
        let count = |attempts: &mut u64| *attempts += 1;
        let reads = Blocking(cluster);
        match inputs {
            Inputs::GetSubscriberData(id) => {
                count(attempts);
                ready(self.get_subscriber_data(&reads, m, id))
            }
            Inputs::GetAccessData(id, ai_type) => {
                count(attempts);
                ready(self.get_access_data(&reads, m, id, ai_type))
            }
            Inputs::GetNewDestination(i) => cluster.txn(m, |tx| {
                count(attempts);
                ready(self.get_new_destination(tx, &i))
            }),
            Inputs::UpdateSubscriberData(i) => cluster.txn(m, |tx| {
                count(attempts);
                ready(self.update_subscriber_data(tx, &i))
            }),
            Inputs::UpdateLocation(nbr, vlr) => {
                let Some(s) = ready(reads.get(&self.sub_nbr, m, &nbr))? else {
                    return Ok(false);
                };
                cluster.txn(m, |tx| {
                    count(attempts);
                    ready(self.update_location(tx, s, vlr))
                })
            }
            Inputs::InsertCallForwarding(i) => cluster.txn(m, |tx| {
                count(attempts);
                ready(self.insert_call_forwarding(tx, &i))
            }),
            Inputs::DeleteCallForwarding(i) => cluster.txn(m, |tx| {
                count(attempts);
                ready(self.delete_call_forwarding(tx, &i))
            }),
        }
    }

    /// [`Tables::run`] as one of many transactions in flight on `pipeline`'s thread.
    pub async fn run_in(
        &self,
        pipeline: &Pipeline<'_>,
        m: Option<MachineId>,
        kind: Kind,
        rng: &mut Rand,
        attempts: &mut u64,
    ) -> Result<bool, TxError> {
        let (m, inputs) = self.inputs(pipeline.machines(), m, kind, rng);
        let count = |attempts: &mut u64| *attempts += 1;
        let p = pipeline;
        match inputs {
            Inputs::GetSubscriberData(id) => {
                count(attempts);
                self.get_subscriber_data(p, m, id).await
            }
            Inputs::GetAccessData(id, ai_type) => {
                count(attempts);
                self.get_access_data(p, m, id, ai_type).await
            }
            Inputs::GetNewDestination(i) => {
                p.txn(m, async |tx| {
                    count(attempts);
                    self.get_new_destination(tx, &i).await
                })
                .await
            }
            Inputs::UpdateSubscriberData(i) => {
                p.txn(m, async |tx| {
                    count(attempts);
                    self.update_subscriber_data(tx, &i).await
                })
                .await
            }
            Inputs::UpdateLocation(nbr, vlr) => {
                let Some(s) = p.get(&self.sub_nbr, m, &nbr).await? else {
                    return Ok(false);
                };
                p.txn(m, async |tx| {
                    count(attempts);
                    self.update_location(tx, s, vlr).await
                })
                .await
            }
            Inputs::InsertCallForwarding(i) => {
                p.txn(m, async |tx| {
                    count(attempts);
                    self.insert_call_forwarding(tx, &i).await
                })
                .await
            }
            Inputs::DeleteCallForwarding(i) => {
                p.txn(m, async |tx| {
                    count(attempts);
                    self.delete_call_forwarding(tx, &i).await
                })
                .await
            }
        }
    }

    /// The coordinator and inputs of a transaction of `kind` in a cluster of `machines`, drawn
    /// from `rng` (`m`, if given, coordinates).
    fn inputs(
        &self,
        machines: u16,
        m: Option<MachineId>,
        kind: Kind,
        rng: &mut Rand,
    ) -> (MachineId, Inputs) {
        let id = s_id(rng, self.subscribers);
        let m = m.unwrap_or(MachineId(partition_of_s_id(id, machines as usize) as u16));
        let inputs = match kind {
            Kind::GetSubscriberData => Inputs::GetSubscriberData(id),
            Kind::GetAccessData => Inputs::GetAccessData(id, rng.range(1, 4) as u8),
            Kind::GetNewDestination => {
                let sf_type = rng.range(1, 4) as u8;
                let start_time = [0u8, 8, 16][rng.range(0, 2) as usize];
                let end_time = rng.range(1, 24) as u8;
                Inputs::GetNewDestination(NewDestinationIn {
                    id,
                    sf_type,
                    start_time,
                    end_time,
                })
            }
            Kind::UpdateSubscriberData => {
                let sf_type = rng.range(1, 4) as u8;
                let bit = rng.range(0, 1) as u16;
                let data_a = rng.next_u64() as u8;
                Inputs::UpdateSubscriberData(SubscriberDataIn {
                    id,
                    sf_type,
                    bit,
                    data_a,
                })
            }
            Kind::UpdateLocation => Inputs::UpdateLocation(sub_nbr(id), rng.next_u64() as u32),
            Kind::InsertCallForwarding => {
                let nbr = sub_nbr(id);
                let sf_type = rng.range(1, 4) as u8;
                let start_time = [0u8, 8, 16][rng.range(0, 2) as usize];
                let cf = CallForwarding {
                    end_time: start_time + rng.range(1, 8) as u8,
                    numberx: rng.digits(),
                };
                Inputs::InsertCallForwarding(CallForwardingIn {
                    nbr,
                    sf_type,
                    start_time,
                    cf: Some(cf),
                })
            }
            Kind::DeleteCallForwarding => {
                let nbr = sub_nbr(id);
                let sf_type = rng.range(1, 4) as u8;
                let start_time = [0u8, 8, 16][rng.range(0, 2) as usize];
                Inputs::DeleteCallForwarding(CallForwardingIn {
                    nbr,
                    sf_type,
                    start_time,
                    cf: None,
                })
            }
        };
        (m, inputs)
    }

    /// GET_SUBSCRIBER_DATA: one lock-free read of the subscriber's row.
    async fn get_subscriber_data(
        &self,
        reads: &impl LockFree,
        m: MachineId,
        id: u32,
    ) -> Result<bool, TxError> {
        Ok(reads.get(&self.subscriber, m, &id).await?.is_some())
    }

    /// GET_ACCESS_DATA: one lock-free read of an access-info row.
    async fn get_access_data(
        &self,
        reads: &impl LockFree,
        m: MachineId,
        id: u32,
        ai_type: u8,
    ) -> Result<bool, TxError> {
        Ok(reads
            .get(&self.access_info, m, &ai_key(id, ai_type))
            .await?
            .is_some())
    }

    /// GET_NEW_DESTINATION in `tx`: whether an active special facility forwards the call.
    async fn get_new_destination(
        &self,
        tx: &mut impl Transaction,
        i: &NewDestinationIn,
    ) -> Result<bool, TxError> {
        let &NewDestinationIn {
            id,
            sf_type,
            start_time,
            end_time,
        } = i;
        let sf = self
            .special_facility
            .get_in_async(tx, &sf_key(id, sf_type))
            .await?;
        let Some(sf) = sf else {
            return Ok(false);
        };
        if sf.is_active != 1 {
            return Ok(false);
        }
        let mut found = false;
        for start in [0u8, 8, 16].into_iter().filter(|s| *s <= start_time) {
            let cf = self
                .call_forwarding
                .get_in_async(tx, &cf_key(id, sf_type, start))
                .await?;
            found |= cf.is_some_and(|cf| end_time < cf.end_time);
        }
        Ok(found)
    }

    /// UPDATE_SUBSCRIBER_DATA in `tx`.
    async fn update_subscriber_data(
        &self,
        tx: &mut impl Transaction,
        i: &SubscriberDataIn,
    ) -> Result<bool, TxError> {
        let &SubscriberDataIn {
            id,
            sf_type,
            bit,
            data_a,
        } = i;
        let key = sf_key(id, sf_type);
        let Some(mut sub) = self.subscriber.get_in_async(tx, &id).await? else {
            return Ok(false);
        };
        sub.bits = (sub.bits & !1) | bit;
        self.subscriber.update_async(tx, &id, &sub).await?;
        let Some(mut sf) = self.special_facility.get_in_async(tx, &key).await? else {
            return Ok(false); // The subscriber's update stands (clause 2.4).
        };
        sf.data_a = data_a;
        self.special_facility.update_async(tx, &key, &sf).await
    }

    /// UPDATE_LOCATION of subscriber `s` in `tx` (its number looked up before, lock-free: the
    /// number index never changes, so a lookup inside the transaction would read the same,
    /// with a read to validate at commit).
    async fn update_location(
        &self,
        tx: &mut impl Transaction,
        s: u32,
        vlr: u32,
    ) -> Result<bool, TxError> {
        let Some(mut sub) = self.subscriber.get_in_async(tx, &s).await? else {
            return Ok(false);
        };
        sub.vlr_location = vlr;
        self.subscriber.update_async(tx, &s, &sub).await
    }

    /// INSERT_CALL_FORWARDING in `tx`.
    async fn insert_call_forwarding(
        &self,
        tx: &mut impl Transaction,
        i: &CallForwardingIn,
    ) -> Result<bool, TxError> {
        let Some(s) = self.sub_nbr.get_in_async(tx, &i.nbr).await? else {
            return Ok(false);
        };
        // The special facilities of the subscriber (the specification selects them all; the
        // insert needs the one of `sf_type`).
        let key = cf_key(s, i.sf_type, i.start_time);
        let sf = self
            .special_facility
            .get_in_async(tx, &sf_key(s, i.sf_type))
            .await?;
        if sf.is_none() {
            return Ok(false);
        }
        let cf = i.cf.as_ref().expect("an insert's row");
        self.call_forwarding.insert_async(tx, &key, cf).await
    }

    /// DELETE_CALL_FORWARDING in `tx`.
    async fn delete_call_forwarding(
        &self,
        tx: &mut impl Transaction,
        i: &CallForwardingIn,
    ) -> Result<bool, TxError> {
        let Some(s) = self.sub_nbr.get_in_async(tx, &i.nbr).await? else {
            return Ok(false);
        };
        let removed = self
            .call_forwarding
            .remove_async(tx, &cf_key(s, i.sf_type, i.start_time))
            .await?;
        Ok(removed.is_some())
    }

    /// Checks the database's integrity after a run: every subscriber is there with its number
    /// indexed, has 1 to 4 access-info and special-facility rows, and every call forwarding
    /// belongs to a special facility, starts at 0, 8 or 16 and ends 1 to 8 later. Reads
    /// through machine `m`. Returns the number of call forwardings, or the first violation.
    pub fn check(&self, cluster: &impl Client, m: MachineId) -> Result<u64, String> {
        let mut call_forwardings = 0;
        for id in 1..=self.subscribers {
            let err = |what: String| format!("subscriber {id}: {what}");
            let sub = self
                .subscriber
                .get(cluster, m, &id)
                .map_err(|e| err(e.to_string()))?
                .ok_or_else(|| err("missing".into()))?;
            if sub.sub_nbr != sub_nbr(id) {
                return Err(err("wrong sub_nbr".into()));
            }
            let indexed = self.sub_nbr.get(cluster, m, &sub.sub_nbr);
            if indexed.map_err(|e| err(e.to_string()))? != Some(id) {
                return Err(err("sub_nbr not indexed to it".into()));
            }
            let ai = (1..=4u8)
                .map(|ty| {
                    let row = self.access_info.get(cluster, m, &ai_key(id, ty));
                    row.map(|r| r.is_some() as u32)
                })
                .sum::<Result<u32, TxError>>()
                .map_err(|e| err(e.to_string()))?;
            if !(1..=4).contains(&ai) {
                return Err(err(format!("{ai} access-info rows")));
            }
            let mut sf = 0;
            for ty in 1..=4u8 {
                let has_sf = self
                    .special_facility
                    .get(cluster, m, &sf_key(id, ty))
                    .map_err(|e| err(e.to_string()))?
                    .is_some();
                sf += has_sf as u32;
                for start in [0u8, 8, 16] {
                    let cf = self
                        .call_forwarding
                        .get(cluster, m, &cf_key(id, ty, start))
                        .map_err(|e| err(e.to_string()))?;
                    if let Some(cf) = cf {
                        if !has_sf {
                            return Err(err(format!(
                                "call forwarding of special facility {ty}, which it lacks"
                            )));
                        }
                        if !(start + 1..=start + 8).contains(&cf.end_time) {
                            return Err(err(format!(
                                "call forwarding {ty}/{start} ends at {}",
                                cf.end_time
                            )));
                        }
                        call_forwardings += 1;
                    }
                }
            }
            if !(1..=4).contains(&sf) {
                return Err(err(format!("{sf} special-facility rows")));
            }
        }
        Ok(call_forwardings)
    }
}

/// 1 to 4 distinct types out of 1 to 4 (clause 4.3: a random number of rows, types unique).
fn pick_types(rng: &mut Rand) -> Vec<u8> {
    let n = rng.range(1, 4) as usize;
    let mut types = vec![1u8, 2, 3, 4];
    for i in 0..4 {
        let j = i + (rng.next_u64() % (4 - i) as u64) as usize;
        types.swap(i, j);
    }
    types.truncate(n);
    types
}

/// One TATP transaction's inputs, drawn before it runs (a retry runs the same one).
enum Inputs {
    GetSubscriberData(u32),
    GetAccessData(u32, u8),
    GetNewDestination(NewDestinationIn),
    UpdateSubscriberData(SubscriberDataIn),
    UpdateLocation([u8; 16], u32),
    InsertCallForwarding(CallForwardingIn),
    DeleteCallForwarding(CallForwardingIn),
}

/// GET_NEW_DESTINATION's inputs.
struct NewDestinationIn {
    id: u32,
    sf_type: u8,
    start_time: u8,
    end_time: u8,
}

/// UPDATE_SUBSCRIBER_DATA's inputs.
struct SubscriberDataIn {
    id: u32,
    sf_type: u8,
    bit: u16,
    data_a: u8,
}

/// INSERT_CALL_FORWARDING's and DELETE_CALL_FORWARDING's inputs (an insert's row in `cf`).
struct CallForwardingIn {
    nbr: [u8; 16],
    sf_type: u8,
    start_time: u8,
    cf: Option<CallForwarding>,
}
