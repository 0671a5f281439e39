//! TPC-C (5.11) on farm: the nine tables with the population of clause 4.3.3.1, the five
//! transactions with the specification's inputs (NURand customers and items, 1% NEW-ORDER
//! rollbacks on an unused item, 1% remote order lines, 15% remote payments, 60% of customers
//! named by last name), and the consistency conditions 1 to 4 of clause 3.3.2. DELIVERY runs
//! one database transaction per district.
//!
//! As in FaRM (§6), point indexes are hash tables co-partitioned by warehouse (warehouse `w`
//! lives on machine `(w - 1) % machines`), except ITEM, copied on every machine, and the
//! ordered ones are B-trees: NEW-ORDER, whose
//! Delivery transaction takes the oldest order of a district, and customers by last name.
//! Money is in cents, rates in ten-thousandths.
//!
//! Physical design (clause 1.4 leaves it free): ORDER-LINE is clustered by order, an order's
//! up to 15 rows stored together under the order's key with the number present ([`OrderLines`]),
//! since every transaction that touches order lines takes all of an order's; hash buckets are
//! small (one to two rows of the large tables) and tables sized for a third to a half full, since
//! a write writes the whole bucket and a read reads it. STOCK-LEVEL, which needs only level 1
//! isolation (clause 3.4.1: no dirty reads or writes), reads committed rows one by one with
//! lock-free reads instead of a serializable transaction.

use bytemuck::{Pod, Zeroable};
use farm::{ready, Addr, Client, MachineId, Pipeline, Transaction, TxError};
use farm_ds::{BTree, HashTable, TableSpec};

use crate::tpcc_input::{
    a_string, data_with_original, last_name, n_string, nurand, zip, NuRandConstants, A_C_LAST,
};
use crate::{Blocking, LockFree, Rand};

/// WAREHOUSE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Warehouse {
    /// `W_YTD`, cents.
    pub ytd: i64,
    /// `W_TAX`, ten-thousandths.
    pub tax: u32,
    /// `W_NAME`.
    pub name: [u8; 10],
    /// `W_STREET_1`, `W_STREET_2`, `W_CITY`.
    pub address: [[u8; 20]; 3],
    /// `W_STATE`.
    pub state: [u8; 2],
    /// `W_ZIP`.
    pub zip: [u8; 9],
    _pad: [u8; 3],
}

/// DISTRICT.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct District {
    /// `D_YTD`, cents.
    pub ytd: i64,
    /// `D_TAX`, ten-thousandths.
    pub tax: u32,
    /// `D_NEXT_O_ID`.
    pub next_o_id: u32,
    /// `D_NAME`.
    pub name: [u8; 10],
    /// `D_STREET_1`, `D_STREET_2`, `D_CITY`.
    pub address: [[u8; 20]; 3],
    /// `D_STATE`.
    pub state: [u8; 2],
    /// `D_ZIP`.
    pub zip: [u8; 9],
    _pad: [u8; 7],
}

/// CUSTOMER.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Customer {
    /// `C_BALANCE`, cents.
    pub balance: i64,
    /// `C_YTD_PAYMENT`, cents.
    pub ytd_payment: i64,
    /// `C_CREDIT_LIM`, cents.
    pub credit_lim: i64,
    /// `C_SINCE`.
    pub since: u64,
    /// `C_DISCOUNT`, ten-thousandths.
    pub discount: u32,
    /// `C_PAYMENT_CNT`.
    pub payment_cnt: u32,
    /// `C_DELIVERY_CNT`.
    pub delivery_cnt: u32,
    /// `C_FIRST`.
    pub first: [u8; 16],
    /// `C_MIDDLE`.
    pub middle: [u8; 2],
    /// `C_LAST`.
    pub last: [u8; 16],
    /// `C_STREET_1`, `C_STREET_2`, `C_CITY`.
    pub address: [[u8; 20]; 3],
    /// `C_STATE`.
    pub state: [u8; 2],
    /// `C_ZIP`.
    pub zip: [u8; 9],
    /// `C_PHONE`.
    pub phone: [u8; 16],
    /// `C_CREDIT`: "GC" or "BC".
    pub credit: [u8; 2],
    /// `C_DATA`.
    pub data: [u8; 500],
    _pad: [u8; 5],
}

/// HISTORY.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct History {
    /// `H_AMOUNT`, cents.
    pub amount: i64,
    /// `H_DATE`.
    pub date: u64,
    /// `H_C_W_ID`, `H_W_ID`.
    pub c_w_id: u32,
    /// `H_W_ID`.
    pub w_id: u32,
    /// `H_C_ID`.
    pub c_id: u32,
    /// `H_C_D_ID`, `H_D_ID`.
    pub c_d_id: u8,
    /// `H_D_ID`.
    pub d_id: u8,
    /// `H_DATA`.
    pub data: [u8; 24],
    _pad: [u8; 2],
}

/// ORDER.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Order {
    /// `O_ENTRY_D`.
    pub entry_d: u64,
    /// `O_C_ID`.
    pub c_id: u32,
    /// `O_CARRIER_ID` (0: null).
    pub carrier_id: u8,
    /// `O_OL_CNT`.
    pub ol_cnt: u8,
    /// `O_ALL_LOCAL`.
    pub all_local: u8,
    _pad: u8,
}

/// ORDER-LINE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct OrderLine {
    /// `OL_DELIVERY_D` (0: null).
    pub delivery_d: u64,
    /// `OL_AMOUNT`, cents.
    pub amount: i64,
    /// `OL_I_ID`.
    pub i_id: u32,
    /// `OL_SUPPLY_W_ID`.
    pub supply_w_id: u32,
    /// `OL_QUANTITY`.
    pub quantity: u32,
    /// `OL_DIST_INFO`.
    pub dist_info: [u8; 24],
    _pad: [u8; 4],
}

/// Most lines of an order (`O_OL_CNT` is 5 to 15).
pub const LINES_MAX: usize = 15;

/// An order's ORDER-LINE rows, stored together (`OL_NUMBER` = index + 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct OrderLines {
    /// Rows present: lines 1 to `count` (condition 4 counts them).
    pub count: u8,
    _pad: [u8; 7],
    /// The rows; those past `count` are zero.
    pub lines: [OrderLine; LINES_MAX],
}

impl OrderLines {
    /// `lines` (at most [`LINES_MAX`]) as an order's rows.
    pub fn new(lines: &[OrderLine]) -> Self {
        assert!(lines.len() <= LINES_MAX, "{} order lines", lines.len());
        let mut all = Self::zeroed();
        all.count = lines.len() as u8;
        all.lines[..lines.len()].copy_from_slice(lines);
        all
    }

    /// The rows present.
    pub fn present(&self) -> &[OrderLine] {
        &self.lines[..self.count.min(LINES_MAX as u8) as usize]
    }

    /// The rows present, to change.
    pub fn present_mut(&mut self) -> &mut [OrderLine] {
        &mut self.lines[..self.count.min(LINES_MAX as u8) as usize]
    }
}

/// ITEM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Item {
    /// `I_PRICE`, cents.
    pub price: i64,
    /// `I_IM_ID`.
    pub im_id: u32,
    /// `I_NAME`.
    pub name: [u8; 24],
    /// `I_DATA`.
    pub data: [u8; 50],
    _pad: [u8; 2],
}

/// STOCK.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Stock {
    /// `S_YTD`.
    pub ytd: u64,
    /// `S_QUANTITY`.
    pub quantity: u32,
    /// `S_ORDER_CNT`.
    pub order_cnt: u32,
    /// `S_REMOTE_CNT`.
    pub remote_cnt: u32,
    /// `S_DIST_01` to `S_DIST_10`.
    pub dist: [[u8; 24]; 10],
    /// `S_DATA`.
    pub data: [u8; 50],
    _pad: [u8; 2],
}

/// Cardinalities: the specification's (clause 4.3.3.1), or smaller for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    /// Warehouses.
    pub warehouses: u32,
    /// Items (100,000), and stock rows per warehouse.
    pub items: u32,
    /// Districts per warehouse (10).
    pub districts: u8,
    /// Customers, and orders, per district (3,000).
    pub customers: u32,
    /// Orders from this one on are undelivered, in NEW-ORDER (2,101).
    pub new_order_from: u32,
    /// NEW-ORDER transactions per district the tables have room for beyond the population
    /// (tables do not grow: an insert into a full one fails, saying so).
    pub growth: u32,
}

impl Scale {
    /// The specification's cardinalities for `warehouses`.
    pub fn spec(warehouses: u32) -> Self {
        Self {
            warehouses,
            items: 100_000,
            districts: 10,
            customers: 3000,
            new_order_from: 2101,
            growth: 30_000,
        }
    }

    /// The specification's cardinalities for `warehouses`, with room for the NEW-ORDERs of a
    /// run of `seconds` (tables do not grow): up to 50 K/s over all districts, well above what
    /// a 2-core machine runs; a run that goes faster stops with an error naming the full table.
    pub fn for_run(warehouses: u32, seconds: f64) -> Self {
        let districts = warehouses as f64 * 10.0;
        Self {
            growth: (50_000.0 * seconds / districts).max(1000.0) as u32,
            ..Self::spec(warehouses)
        }
    }
}

/// DISTRICT's key.
pub fn d_key(w: u32, d: u8) -> u64 {
    (w as u64) << 8 | d as u64
}

/// CUSTOMER's key.
pub fn c_key(w: u32, d: u8, c: u32) -> u64 {
    d_key(w, d) << 16 | c as u64
}

/// ORDER's and NEW-ORDER's key.
pub fn o_key(w: u32, d: u8, o: u32) -> u64 {
    d_key(w, d) << 32 | o as u64
}

/// The key of orders by customer: the customer, then the order id.
pub fn co_key(w: u32, d: u8, c: u32, o: u32) -> u64 {
    c_key(w, d, c) << 24 | o as u64
}

/// HISTORY's key (it has none of its own): the district and a number unique in it.
pub fn h_key(w: u32, d: u8, n: u64) -> u64 {
    d_key(w, d) << 40 | (n & ((1 << 40) - 1))
}

/// ITEM's key: item `i` of the copy of machine `copy` (every machine keeps a copy of ITEM,
/// which no transaction writes, so that NEW-ORDER reads and validates its items locally).
pub fn i_key(copy: usize, i: u32) -> u64 {
    (copy as u64) << 32 | i as u64
}

/// STOCK's key.
pub fn s_key(w: u32, i: u32) -> u64 {
    (w as u64) << 20 | i as u64
}

/// The key of customers by last name: warehouse, district, last, first, id, in an order that
/// sorts as the specification's (C_LAST, C_FIRST).
pub fn name_key(w: u32, d: u8, last: &[u8; 16], first: &[u8; 16], c: u32) -> [u8; 40] {
    let mut k = [0u8; 40];
    k[..4].copy_from_slice(&w.to_be_bytes());
    k[4] = d;
    k[5..21].copy_from_slice(last);
    k[21..37].copy_from_slice(first);
    k[37..40].copy_from_slice(&c.to_be_bytes()[1..]);
    k
}

/// The machine of warehouse `w`, among `machines`: warehouse w lives on machine
/// (w - 1) mod machines, and its clients run there.
pub fn warehouse_machine(w: u64, machines: usize) -> usize {
    (w.saturating_sub(1)) as usize % machines
}

/// Transactions in flight while loading: the load waits for replication round trips side by
/// side, not one after another. The transactions write disjoint rows but may share a hash
/// bucket or a B-tree leaf; such conflicts are retried.
const LOAD_IN_FLIGHT: usize = 8;

/// Runs `load(tx, k)` for every `k` below `n`, each in a transaction of its own coordinated by
/// `m`, [`LOAD_IN_FLIGHT`] at a time on the calling thread, and `done(k)` once `k` committed;
/// the first error ends the load.
fn load_in_flight(
    cluster: &impl Client,
    m: MachineId,
    n: usize,
    load: impl AsyncFn(&mut farm::AsyncTxn<'_, '_>, usize) -> Result<(), TxError>,
    done: impl Fn(usize),
) -> Result<(), TxError> {
    let next = std::cell::Cell::new(0);
    let failed = std::cell::RefCell::new(None);
    cluster.pipeline(LOAD_IN_FLIGHT.min(n), async |p, _| loop {
        let k = next.get();
        if k >= n || failed.borrow().is_some() {
            return;
        }
        next.set(k + 1);
        match p.txn(m, async |tx| load(tx, k).await).await {
            Ok(()) => done(k),
            Err(e) => {
                failed.borrow_mut().get_or_insert(e);
            }
        }
    });
    failed.into_inner().map_or(Ok(()), Err)
}

/// Entries per node of the customer-by-name B-trees.
const NAME_FANOUT: usize = 32;
/// Entries per node of the NEW-ORDER and orders-by-customer B-trees.
const ORDER_FANOUT: usize = 64;

/// The shapes of the hash tables for a scale over some machines: what [`Tables::create`]
/// makes and [`Tables::bytes_per_machine`] sizes.
struct Shapes {
    /// Warehouses on the machine that has the most.
    per_machine: u64,
    warehouse: TableSpec,
    district: TableSpec,
    customer: TableSpec,
    history: TableSpec,
    order: TableSpec,
    order_line: TableSpec,
    item: TableSpec,
    stock: TableSpec,
}

impl Shapes {
    fn of(scale: Scale, n: usize) -> Self {
        let machines: Vec<MachineId> = (0..n as u16).map(MachineId).collect();
        // A partition holds the rows of the warehouses of one machine: sized for the most any
        // machine has, at half fill.
        let per_machine = scale.warehouses.div_ceil(n as u32) as u64;
        let d = scale.districts as u64;
        let c = scale.customers as u64;
        let orders = c + scale.growth as u64;
        // `rows_per_slot`: the fill (a half, or a third where overflows should be rarer: a
        // lookup whose home bucket overflowed takes a transaction).
        let spec = |per_warehouse: u64, slots: u8, slots_per_row: u64| TableSpec {
            partitions: machines.clone(),
            buckets: (per_machine * per_warehouse * slots_per_row)
                .div_ceil(slots as u64)
                .max(1) as u32,
            slots,
        };
        Self {
            per_machine,
            warehouse: spec(1, 1, 3),
            district: spec(d, 1, 3),
            customer: spec(d * c, 1, 3),
            history: spec(d * orders, 2, 2),
            order: spec(d * orders, 4, 2),
            order_line: spec(d * orders, 1, 2),
            // A copy of ITEM per machine, each at half fill: partition m is machine m's copy.
            item: TableSpec::with_capacity(machines.clone(), scale.items as u64 * n as u64, 2),
            stock: spec(scale.items as u64, 1, 3),
        }
    }
}

/// Creates partition `p` of the hash table of `spec` and adds its directory pages to `pages`.
fn partition_pages<K: Pod, V: Pod>(
    cluster: &impl Client,
    spec: &TableSpec,
    p: usize,
    pages: &mut Vec<Addr>,
) -> Result<(), TxError> {
    pages.extend(HashTable::<K, V>::create_partition(cluster, spec, p)?);
    Ok(())
}

/// The hash table of `spec` whose partitions' directory pages are `pages` (by partition): its
/// root, made on the first partition's machine, opened there.
fn rooted<K: Pod, V: Pod>(
    cluster: &impl Client,
    spec: &TableSpec,
    pages: &[Vec<Addr>],
) -> Result<HashTable<K, V>, TxError> {
    let root = HashTable::<K, V>::create_root(cluster, spec, pages)?;
    HashTable::open(cluster, spec.partitions[0], root)
}

/// One B-tree per warehouse, each created on the warehouse's machine so that its nodes (splits
/// allocate next to the node they split) live with the warehouse's rows: a warehouse's
/// transactions then lock and replicate at one primary (§6.1 co-partitions TPC-C by
/// warehouse). Its keys all begin with the warehouse id.
#[derive(Clone, Debug)]
pub struct PerWarehouse<K, V>(Vec<BTree<K, V>>);

impl<K: Pod + Ord, V: Pod> PerWarehouse<K, V> {
    fn create(cluster: &impl Client, warehouses: u32, fanout: usize) -> Result<Self, TxError> {
        let machines = cluster.machines() as usize;
        (1..=warehouses as u64)
            .map(|w| {
                let m = MachineId(warehouse_machine(w, machines) as u16);
                BTree::create(cluster, m, fanout, None)
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }

    /// The tree of warehouse `w`.
    pub fn of(&self, w: u32) -> &BTree<K, V> {
        &self.0[w as usize - 1]
    }

    fn metas(&self) -> impl Iterator<Item = Addr> + '_ {
        self.0.iter().map(BTree::meta)
    }

    fn open(cluster: &impl Client, machine: MachineId, metas: &[Addr]) -> Result<Self, TxError> {
        metas
            .iter()
            .map(|m| BTree::open(cluster, machine, *m))
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

/// The tables of one TPC-C database.
#[derive(Clone, Debug)]
pub struct Tables {
    /// Cardinalities.
    pub scale: Scale,
    /// The NURand constants the population used (clause 2.1.6.1).
    pub constants: NuRandConstants,
    /// WAREHOUSE by `W_ID`.
    pub warehouse: HashTable<u32, Warehouse>,
    /// DISTRICT by [`d_key`].
    pub district: HashTable<u64, District>,
    /// CUSTOMER by [`c_key`].
    pub customer: HashTable<u64, Customer>,
    /// Customers by [`name_key`], to their `C_ID`.
    pub customer_by_name: PerWarehouse<[u8; 40], u32>,
    /// HISTORY by a unique id (it has no key of its own).
    pub history: HashTable<u64, History>,
    /// ORDER by [`o_key`].
    pub order: HashTable<u64, Order>,
    /// NEW-ORDER by [`o_key`], in order.
    pub new_order: PerWarehouse<u64, u8>,
    /// Orders by customer, [`co_key`], in order (ORDER-STATUS reads a customer's newest).
    pub order_by_customer: PerWarehouse<u64, u8>,
    /// ORDER-LINE, clustered by order: an order's rows by [`o_key`].
    pub order_line: HashTable<u64, OrderLines>,
    /// ITEM by [`i_key`]: a copy on every machine (FaRM's TPC-C reads remote data in about 10%
    /// of its transactions, §6.3: remote customers and stock, not items).
    pub item: HashTable<u64, Item>,
    /// STOCK by [`s_key`].
    pub stock: HashTable<u64, Stock>,
}

impl Tables {
    /// Creates empty tables for `scale` on every machine of `cluster`.
    pub fn create(cluster: &impl Client, scale: Scale, seed: u64) -> Result<Self, TxError> {
        let pages = (0..cluster.machines())
            .map(|m| Self::create_partition(cluster, scale, MachineId(m)))
            .collect::<Result<Vec<_>, _>>()?;
        Self::create_from(cluster, scale, seed, &pages)
    }

    /// The first half of [`Tables::create`], for the machines of a cluster to do at once:
    /// machine `me`'s partition of every hash table (its buckets and their directory pages, in
    /// regions it is primary of), whose pages [`Tables::create_from`] takes.
    pub fn create_partition(
        cluster: &impl Client,
        scale: Scale,
        me: MachineId,
    ) -> Result<Vec<Addr>, TxError> {
        let s = Shapes::of(scale, cluster.machines() as usize);
        let p = me.0 as usize;
        let mut pages = Vec::new();
        partition_pages::<u32, Warehouse>(cluster, &s.warehouse, p, &mut pages)?;
        partition_pages::<u64, District>(cluster, &s.district, p, &mut pages)?;
        partition_pages::<u64, Customer>(cluster, &s.customer, p, &mut pages)?;
        partition_pages::<u64, History>(cluster, &s.history, p, &mut pages)?;
        partition_pages::<u64, Order>(cluster, &s.order, p, &mut pages)?;
        partition_pages::<u64, OrderLines>(cluster, &s.order_line, p, &mut pages)?;
        partition_pages::<u64, Item>(cluster, &s.item, p, &mut pages)?;
        partition_pages::<u64, Stock>(cluster, &s.stock, p, &mut pages)?;
        Ok(pages)
    }

    /// The second half of [`Tables::create`]: the hash tables' roots from every machine's
    /// [`Tables::create_partition`] (by machine), and the B-trees.
    pub fn create_from(
        cluster: &impl Client,
        scale: Scale,
        seed: u64,
        pages: &[Vec<Addr>],
    ) -> Result<Self, TxError> {
        let n = cluster.machines() as usize;
        let s = Shapes::of(scale, n);
        let specs = [
            &s.warehouse,
            &s.district,
            &s.customer,
            &s.history,
            &s.order,
            &s.order_line,
            &s.item,
            &s.stock,
        ];
        let expected: usize = specs.iter().map(|s| s.pages_per_partition()).sum();
        if pages.len() != n || pages.iter().any(|p| p.len() != expected) {
            return Err(TxError::Aborted(format!(
                "TPC-C tables: {n} machines' partitions of {expected} directory pages each, not \
                 {:?}",
                pages.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        // Table `t`'s pages, by machine.
        let mut at = 0;
        let mut of = |spec: &TableSpec| {
            let k = spec.pages_per_partition();
            let table: Vec<Vec<Addr>> = pages.iter().map(|p| p[at..at + k].to_vec()).collect();
            at += k;
            table
        };
        let warehouse = rooted(cluster, &s.warehouse, &of(&s.warehouse))?;
        let district = rooted(cluster, &s.district, &of(&s.district))?;
        let customer = rooted(cluster, &s.customer, &of(&s.customer))?;
        let history = rooted(cluster, &s.history, &of(&s.history))?;
        let order = rooted(cluster, &s.order, &of(&s.order))?;
        let order_line = rooted(cluster, &s.order_line, &of(&s.order_line))?;
        let item = rooted(cluster, &s.item, &of(&s.item))?;
        let stock = rooted(cluster, &s.stock, &of(&s.stock))?;
        Ok(Self {
            scale,
            constants: NuRandConstants::draw(&mut Rand::new(seed)),
            warehouse,
            district,
            customer,
            customer_by_name: PerWarehouse::create(cluster, scale.warehouses, NAME_FANOUT)?,
            history,
            order,
            new_order: PerWarehouse::create(cluster, scale.warehouses, ORDER_FANOUT)?,
            order_by_customer: PerWarehouse::create(cluster, scale.warehouses, ORDER_FANOUT)?,
            order_line,
            item,
            stock,
        }
        .partitioned(n))
    }

    /// At most how many bytes the tables for `scale` take on each of `machines` machines once
    /// every NEW-ORDER they have room for ran: the hash tables' buckets (created at once) and
    /// the B-trees of the machine's warehouses, full ([`TableSpec::bytes_per_partition`],
    /// [`BTree::bytes_for`]); not the hash tables' overflow buckets, which their fill (a half
    /// or a third) keeps rare. What to size a cluster's regions by.
    pub fn bytes_per_machine(scale: Scale, machines: usize) -> u64 {
        let s = Shapes::of(scale, machines);
        let hash = s.warehouse.bytes_per_partition::<u32, Warehouse>()
            + s.district.bytes_per_partition::<u64, District>()
            + s.customer.bytes_per_partition::<u64, Customer>()
            + s.history.bytes_per_partition::<u64, History>()
            + s.order.bytes_per_partition::<u64, Order>()
            + s.order_line.bytes_per_partition::<u64, OrderLines>()
            + s.item.bytes_per_partition::<u64, Item>()
            + s.stock.bytes_per_partition::<u64, Stock>();
        let d = scale.districts as u64;
        let orders = d * (scale.customers as u64 + scale.growth as u64);
        let trees = BTree::<[u8; 40], u32>::bytes_for(NAME_FANOUT, d * scale.customers as u64)
            + 2 * BTree::<u64, u8>::bytes_for(ORDER_FANOUT, orders);
        hash + s.per_machine * trees
    }

    /// Rows partitioned by warehouse over `machines`: a warehouse's rows live on its machine.
    fn partitioned(self, machines: usize) -> Self {
        let by_w = move |w: u64| warehouse_machine(w, machines);
        Self {
            warehouse: self
                .warehouse
                .with_partitioner(move |w: &u32| by_w(*w as u64)),
            district: self.district.with_partitioner(move |k: &u64| by_w(k >> 8)),
            customer: self.customer.with_partitioner(move |k: &u64| by_w(k >> 24)),
            history: self.history.with_partitioner(move |k: &u64| by_w(k >> 48)),
            order: self.order.with_partitioner(move |k: &u64| by_w(k >> 40)),
            order_line: self
                .order_line
                .with_partitioner(move |k: &u64| by_w(k >> 40)),
            stock: self.stock.with_partitioner(move |k: &u64| by_w(k >> 20)),
            item: self.item.with_partitioner(|k: &u64| (k >> 32) as usize),
            ..self
        }
    }

    /// The tables' roots, from which [`Tables::open`] opens them elsewhere (another process):
    /// the hash tables', then each warehouse's B-trees.
    pub fn roots(&self) -> Vec<Addr> {
        [
            self.warehouse.root(),
            self.district.root(),
            self.customer.root(),
            self.history.root(),
            self.order.root(),
            self.order_line.root(),
            self.item.root(),
            self.stock.root(),
        ]
        .into_iter()
        .chain(self.customer_by_name.metas())
        .chain(self.new_order.metas())
        .chain(self.order_by_customer.metas())
        .collect()
    }

    /// Opens the tables that [`Tables::create`] made for `scale` with `seed`, from their
    /// [`Tables::roots`], reading through `machine`.
    pub fn open(
        cluster: &impl Client,
        machine: MachineId,
        scale: Scale,
        seed: u64,
        roots: &[Addr],
    ) -> Result<Self, TxError> {
        let w = scale.warehouses as usize;
        if roots.len() != 8 + 3 * w {
            return Err(TxError::Aborted(format!(
                "{} roots for {w} warehouses: expected {}",
                roots.len(),
                8 + 3 * w
            )));
        }
        let trees = &roots[8..];
        Ok(Self {
            scale,
            constants: NuRandConstants::draw(&mut Rand::new(seed)),
            warehouse: HashTable::open(cluster, machine, roots[0])?,
            district: HashTable::open(cluster, machine, roots[1])?,
            customer: HashTable::open(cluster, machine, roots[2])?,
            history: HashTable::open(cluster, machine, roots[3])?,
            order: HashTable::open(cluster, machine, roots[4])?,
            order_line: HashTable::open(cluster, machine, roots[5])?,
            item: HashTable::open(cluster, machine, roots[6])?,
            stock: HashTable::open(cluster, machine, roots[7])?,
            customer_by_name: PerWarehouse::open(cluster, machine, &trees[..w])?,
            new_order: PerWarehouse::open(cluster, machine, &trees[w..2 * w])?,
            order_by_customer: PerWarehouse::open(cluster, machine, &trees[2 * w..])?,
        }
        .partitioned(cluster.machines() as usize))
    }

    /// The machine where warehouse `w`'s rows live.
    pub fn machine_of(&self, cluster: &impl Client, w: u32) -> MachineId {
        self.machine_of_among(cluster.machines(), w)
    }

    /// [`Tables::machine_of`] in a cluster of `machines` machines.
    pub fn machine_of_among(&self, machines: u16, w: u32) -> MachineId {
        MachineId(warehouse_machine(w as u64, machines as usize) as u16)
    }

    /// Loads ITEM (clause 4.3.3.1), every machine's copy, in transactions of `batch` rows.
    pub fn populate_items(
        &self,
        cluster: &impl Client,
        batch: u32,
        seed: u64,
    ) -> Result<(), TxError> {
        (0..self.item.partitions())
            .try_for_each(|m| self.populate_item_copy(cluster, batch, seed, m))
    }

    /// Loads machine `copy`'s copy of ITEM, coordinated there, in transactions of `batch` rows
    /// (so that the machines of a cluster load their copies at once).
    pub fn populate_item_copy(
        &self,
        cluster: &impl Client,
        batch: u32,
        seed: u64,
        copy: usize,
    ) -> Result<(), TxError> {
        if copy >= self.item.partitions() {
            return Err(TxError::Aborted(format!(
                "no copy {copy} of ITEM: the tables have {}",
                self.item.partitions()
            )));
        }
        let ids: Vec<u32> = (1..=self.scale.items).collect();
        let chunks: Vec<&[u32]> = ids.chunks(batch.max(1) as usize).collect();
        let load = async |tx: &mut farm::AsyncTxn<'_, '_>, k: usize| {
            for &id in chunks[k] {
                let mut rng = Rand::new(seed ^ 0x17e3 ^ (id as u64) << 24);
                let item = Item {
                    price: rng.range(100, 10_000) as i64,
                    im_id: rng.range(1, 10_000) as u32,
                    name: a_string(&mut rng, 14, 24),
                    data: data_with_original(&mut rng),
                    _pad: [0; 2],
                };
                self.item.insert_async(tx, &i_key(copy, id), &item).await?;
            }
            Ok(())
        };
        load_in_flight(cluster, MachineId(copy as u16), chunks.len(), load, |_| {})
    }

    /// Loads warehouse `w`: its row, its stock, its districts with their customers, history,
    /// orders, order lines and new orders (clause 4.3.3.1), coordinated where it lives, calling
    /// `progress` with rows loaded.
    pub fn populate_warehouse(
        &self,
        cluster: &impl Client,
        w: u32,
        seed: u64,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), TxError> {
        let m = self.machine_of(cluster, w);
        let s = self.scale;
        let mut rng = Rand::new(seed ^ (w as u64) << 32);
        // W_YTD is 300,000.00 with 10 districts of 30,000.00 each: the sum of its districts'.
        let warehouse = Warehouse {
            ytd: 3_000_000 * s.districts as i64,
            tax: rng.range(0, 2000) as u32,
            name: a_string(&mut rng, 6, 10),
            address: [
                a_string(&mut rng, 10, 20),
                a_string(&mut rng, 10, 20),
                a_string(&mut rng, 10, 20),
            ],
            state: a_string(&mut rng, 2, 2),
            zip: zip(&mut rng),
            _pad: [0; 3],
        };
        cluster.txn(m, |tx| {
            self.warehouse.insert(tx, &w, &warehouse).map(|_| ())
        })?;
        let items: Vec<u32> = (1..=s.items).collect();
        let chunks: Vec<&[u32]> = items.chunks(16).collect();
        let load = async |tx: &mut farm::AsyncTxn<'_, '_>, k: usize| {
            for &i in chunks[k] {
                let mut rng = Rand::new(seed ^ (w as u64) << 40 ^ i as u64);
                let stock = Stock {
                    ytd: 0,
                    quantity: rng.range(10, 100) as u32,
                    order_cnt: 0,
                    remote_cnt: 0,
                    dist: std::array::from_fn(|_| a_string(&mut rng, 24, 24)),
                    data: data_with_original(&mut rng),
                    _pad: [0; 2],
                };
                self.stock.insert_async(tx, &s_key(w, i), &stock).await?;
            }
            Ok(())
        };
        load_in_flight(cluster, m, chunks.len(), load, |k| {
            progress(chunks[k].len() as u64)
        })?;
        for d in 1..=s.districts {
            self.populate_district(cluster, m, w, d, &mut rng, progress)?;
        }
        Ok(())
    }

    fn populate_district(
        &self,
        cluster: &impl Client,
        m: MachineId,
        w: u32,
        d: u8,
        rng: &mut Rand,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), TxError> {
        let s = self.scale;
        let district = District {
            ytd: 3_000_000,
            tax: rng.range(0, 2000) as u32,
            next_o_id: s.customers + 1,
            name: a_string(rng, 6, 10),
            address: [
                a_string(rng, 10, 20),
                a_string(rng, 10, 20),
                a_string(rng, 10, 20),
            ],
            state: a_string(rng, 2, 2),
            zip: zip(rng),
            _pad: [0; 7],
        };
        cluster.txn(m, |tx| {
            self.district
                .insert(tx, &d_key(w, d), &district)
                .map(|_| ())
        })?;
        // Customers, each with a history row; the rows are drawn first, in order, and loaded
        // several transactions at a time (their B-tree inserts may conflict: retried).
        let customers: Vec<(u32, Customer)> = (1..=s.customers)
            .map(|c| (c, self.new_customer(c, rng)))
            .collect();
        let customers: Vec<&[(u32, Customer)]> = customers.chunks(4).collect();
        let load = async |tx: &mut farm::AsyncTxn<'_, '_>, k: usize| {
            for (c, row) in customers[k] {
                let c = *c;
                self.customer.insert_async(tx, &c_key(w, d, c), row).await?;
                let key = name_key(w, d, &row.last, &row.first, c);
                self.customer_by_name
                    .of(w)
                    .insert_async(tx, &key, &c)
                    .await?;
                let h = History {
                    amount: 1000,
                    date: 0,
                    c_w_id: w,
                    w_id: w,
                    c_id: c,
                    c_d_id: d,
                    d_id: d,
                    data: [b'h'; 24],
                    _pad: [0; 2],
                };
                self.history
                    .insert_async(tx, &h_key(w, d, c as u64), &h)
                    .await?;
            }
            Ok(())
        };
        load_in_flight(cluster, m, customers.len(), load, |k| {
            progress(customers[k].len() as u64)
        })?;
        // Orders: customers in a random permutation, one order each.
        let mut perm: Vec<u32> = (1..=s.customers).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let orders: Vec<(u32, Order, Vec<OrderLine>)> = (1..=s.customers)
            .map(|o| {
                let delivered = o < s.new_order_from;
                let order = Order {
                    entry_d: 1,
                    c_id: perm[o as usize - 1],
                    carrier_id: if delivered { rng.range(1, 10) as u8 } else { 0 },
                    ol_cnt: rng.range(5, 15) as u8,
                    all_local: 1,
                    _pad: 0,
                };
                let lines = (0..order.ol_cnt)
                    .map(|_| OrderLine {
                        delivery_d: delivered as u64,
                        amount: if delivered {
                            0
                        } else {
                            rng.range(1, 999_999) as i64
                        },
                        i_id: rng.range(1, s.items as u64) as u32,
                        supply_w_id: w,
                        quantity: 5,
                        dist_info: a_string(rng, 24, 24),
                        _pad: [0; 4],
                    })
                    .collect();
                (o, order, lines)
            })
            .collect();
        let orders: Vec<&[(u32, Order, Vec<OrderLine>)]> = orders.chunks(3).collect();
        let load = async |tx: &mut farm::AsyncTxn<'_, '_>, k: usize| {
            for (o, order, lines) in orders[k] {
                let key = o_key(w, d, *o);
                self.order.insert_async(tx, &key, order).await?;
                let by_customer = co_key(w, d, order.c_id, *o);
                self.order_by_customer
                    .of(w)
                    .insert_async(tx, &by_customer, &0)
                    .await?;
                self.order_line
                    .insert_async(tx, &key, &OrderLines::new(lines))
                    .await?;
                if *o >= s.new_order_from {
                    self.new_order.of(w).insert_async(tx, &key, &0).await?;
                }
            }
            Ok(())
        };
        load_in_flight(cluster, m, orders.len(), load, |k| {
            progress(orders[k].len() as u64)
        })
    }

    fn new_customer(&self, c: u32, rng: &mut Rand) -> Customer {
        let last = if c <= 1000 {
            last_name(c as u64 - 1)
        } else {
            last_name(nurand(rng, A_C_LAST, self.constants.c_last_load, 0, 999))
        };
        Customer {
            balance: -1000,
            ytd_payment: 1000,
            credit_lim: 5_000_000,
            since: 0,
            discount: rng.range(0, 5000) as u32,
            payment_cnt: 1,
            delivery_cnt: 0,
            first: a_string(rng, 8, 16),
            middle: *b"OE",
            last,
            address: [
                a_string(rng, 10, 20),
                a_string(rng, 10, 20),
                a_string(rng, 10, 20),
            ],
            state: a_string(rng, 2, 2),
            zip: zip(rng),
            phone: n_string(rng, 16, 16),
            credit: if rng.range(1, 10) == 1 {
                *b"BC"
            } else {
                *b"GC"
            },
            data: a_string(rng, 300, 500),
            _pad: [0; 5],
        }
    }

    /// Checks the consistency conditions 1 to 4 of clause 3.3.2 for every warehouse and
    /// district, reading through machine `m` in transactions of bounded size (run it at
    /// quiescence); the first violation, named, if any.
    pub fn check(&self, cluster: &impl Client, m: MachineId) -> Result<(), String> {
        let fail = |w: u32| move |e: TxError| format!("warehouse {w}: {e}");
        for w in 1..=self.scale.warehouses {
            // Condition 1: W_YTD = sum(D_YTD).
            let (w_ytd, districts) = cluster
                .txn(m, |tx| {
                    let Some(warehouse) = self.warehouse.get_in(tx, &w)? else {
                        return Err(tx.abort("missing"));
                    };
                    let mut districts = Vec::new();
                    for d in 1..=self.scale.districts {
                        let Some(row) = self.district.get_in(tx, &d_key(w, d))? else {
                            return Err(tx.abort(format!("district {d} missing")));
                        };
                        districts.push(row);
                    }
                    Ok((warehouse.ytd, districts))
                })
                .map_err(fail(w))?;
            let d_ytd: i64 = districts.iter().map(|d| d.ytd).sum();
            if w_ytd != d_ytd {
                return Err(format!(
                    "warehouse {w}: condition 1: W_YTD {w_ytd} != sum(D_YTD) {d_ytd}"
                ));
            }
            for (d, district) in (1..=self.scale.districts).zip(&districts) {
                self.check_district(cluster, m, w, d, district.next_o_id)
                    .map_err(|e| format!("warehouse {w} district {d}: {e}"))?;
            }
        }
        Ok(())
    }

    /// Conditions 2 to 4 for one district whose `D_NEXT_O_ID` is `next`.
    fn check_district(
        &self,
        cluster: &impl Client,
        m: MachineId,
        w: u32,
        d: u8,
        next: u32,
    ) -> Result<(), String> {
        let last = next - 1;
        let (newest_there, after_there, new_orders) = cluster
            .txn(m, |tx| {
                let newest = self.order.get_in(tx, &o_key(w, d, last))?.is_some();
                let after = self.order.get_in(tx, &o_key(w, d, next))?.is_some();
                let from = o_key(w, d, 0);
                let to = o_key(w, d + 1, 0);
                let rows = self
                    .new_order
                    .of(w)
                    .range(tx, &from, Some(&to), usize::MAX)?;
                Ok((newest, after, rows))
            })
            .map_err(|e| e.to_string())?;
        // Condition 2: D_NEXT_O_ID - 1 = max(O_ID) = max(NO_O_ID).
        if !newest_there || after_there {
            return Err(format!(
                "condition 2: D_NEXT_O_ID - 1 = {last} is not the newest order"
            ));
        }
        if let (Some(first), Some(newest)) = (new_orders.first(), new_orders.last()) {
            let (min, max) = (first.0 as u32, newest.0 as u32);
            if max != last {
                return Err(format!(
                    "condition 2: max(NO_O_ID) {max} != D_NEXT_O_ID - 1 {last}"
                ));
            }
            // Condition 3: max(NO_O_ID) - min(NO_O_ID) + 1 = rows in NEW-ORDER.
            if (max - min + 1) as usize != new_orders.len() {
                return Err(format!(
                    "condition 3: NEW-ORDER holds {} rows for orders {min} to {max}",
                    new_orders.len()
                ));
            }
        }
        // Condition 4: sum(O_OL_CNT) = rows in ORDER-LINE.
        let (mut ol_cnt, mut lines) = (0u64, 0u64);
        let orders: Vec<u32> = (1..=last).collect();
        for chunk in orders.chunks(50) {
            let (c, l) = cluster
                .txn(m, |tx| {
                    let (mut c, mut l) = (0u64, 0u64);
                    for &o in chunk {
                        let Some(order) = self.order.get_in(tx, &o_key(w, d, o))? else {
                            return Err(tx.abort(format!("order {o} missing")));
                        };
                        c += order.ol_cnt as u64;
                        if let Some(lines) = self.order_line.get_in(tx, &o_key(w, d, o))? {
                            l += lines.present().len() as u64;
                        }
                    }
                    Ok((c, l))
                })
                .map_err(|e| e.to_string())?;
            ol_cnt += c;
            lines += l;
        }
        if ol_cnt != lines {
            return Err(format!(
                "condition 4: sum(O_OL_CNT) {ol_cnt} != {lines} order lines"
            ));
        }
        Ok(())
    }
}

/// The five transactions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// NEW-ORDER (clause 2.4).
    NewOrder,
    /// PAYMENT (clause 2.5).
    Payment,
    /// ORDER-STATUS (clause 2.6).
    OrderStatus,
    /// DELIVERY (clause 2.7).
    Delivery,
    /// STOCK-LEVEL (clause 2.8).
    StockLevel,
}

impl Kind {
    /// All kinds.
    pub const ALL: [Kind; 5] = [
        Kind::NewOrder,
        Kind::Payment,
        Kind::OrderStatus,
        Kind::Delivery,
        Kind::StockLevel,
    ];

    /// The specification's name.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::NewOrder => "NEW-ORDER",
            Kind::Payment => "PAYMENT",
            Kind::OrderStatus => "ORDER-STATUS",
            Kind::Delivery => "DELIVERY",
            Kind::StockLevel => "STOCK-LEVEL",
        }
    }

    /// The full mix (45/43/4/4/4) or NEW-ORDER and PAYMENT only (50/50), from a draw below 100.
    pub fn from_draw(draw: u64, new_order_payment_only: bool) -> Kind {
        match (new_order_payment_only, draw) {
            (true, 0..=49) => Kind::NewOrder,
            (true, _) => Kind::Payment,
            (false, 0..=44) => Kind::NewOrder,
            (false, 45..=87) => Kind::Payment,
            (false, 88..=91) => Kind::OrderStatus,
            (false, 92..=95) => Kind::Delivery,
            (false, _) => Kind::StockLevel,
        }
    }
}

/// What a transaction did, for the books.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Committed.
    Committed,
    /// A NEW-ORDER rolled back as the specification asks of 1% (an unused item number).
    RolledBack,
}

/// One transaction's inputs, drawn as the specification says before it runs (so that a retry
/// runs the same business transaction).
enum Inputs {
    NewOrder(NewOrderIn),
    Payment(PaymentIn),
    OrderStatus(OrderStatusIn),
    Delivery(DeliveryIn),
    StockLevel(StockLevelIn),
}

/// NEW-ORDER's inputs (clause 2.4.1): the customer, and per line the item, its supplying
/// warehouse and the quantity.
struct NewOrderIn {
    w: u32,
    d: u8,
    c: u32,
    lines: Vec<(u32, u32, u32)>,
    now: u64,
}

/// PAYMENT's inputs (clause 2.5.1).
struct PaymentIn {
    w: u32,
    d: u8,
    c_w: u32,
    c_d: u8,
    by_name: Option<[u8; 16]>,
    id: u32,
    amount: i64,
    seq: u64,
    now: u64,
}

/// ORDER-STATUS's inputs (clause 2.6.1).
struct OrderStatusIn {
    w: u32,
    d: u8,
    by_name: Option<[u8; 16]>,
    id: u32,
}

/// DELIVERY's inputs (clause 2.7.1).
struct DeliveryIn {
    w: u32,
    carrier: u8,
    now: u64,
}

/// STOCK-LEVEL's inputs (clause 2.8.1).
struct StockLevelIn {
    w: u32,
    d: u8,
    threshold: u32,
}

/// What a NEW-ORDER's commit or abort means for the books.
fn new_order_outcome(result: Result<(), TxError>) -> Result<Outcome, TxError> {
    match result {
        Ok(()) => Ok(Outcome::Committed),
        Err(TxError::Aborted(why)) if why == ROLLBACK => Ok(Outcome::RolledBack),
        Err(e) => Err(e),
    }
}

impl Tables {
    /// Runs one transaction of `kind` for home warehouse `w` with the specification's inputs,
    /// coordinated on `m` (by default where `w` lives). `now` stands for the current time;
    /// `attempts` counts executions (more than one when conflicts made it retry). Blocks the
    /// thread until it ends; [`Tables::run_in`] runs it among others in flight.
    pub fn run(
        &self,
        cluster: &impl Client,
        m: Option<MachineId>,
        (kind, w): (Kind, u32),
        rng: &mut Rand,
        now: u64,
        attempts: &mut u64,
    ) -> Result<Outcome, TxError> {
        let m = m.unwrap_or(self.machine_of(cluster, w));
        let count = |attempts: &mut u64| *attempts += 1;
        match self.inputs(kind, w, rng, now) {
            Inputs::NewOrder(i) => new_order_outcome(cluster.txn(m, |tx| {
                count(attempts);
                ready(self.new_order(tx, &i))
            })),
            Inputs::Payment(i) => cluster.txn(m, |tx| {
                count(attempts);
                ready(self.payment(tx, &i))
            }),
            Inputs::OrderStatus(i) => cluster.txn(m, |tx| {
                count(attempts);
                ready(self.order_status(tx, &i))
            }),
            Inputs::Delivery(i) => {
                // One database transaction per district (clause 2.7.4.2 allows it; ten in one
                // exceed a log record's size). The business transaction counts one execution,
                // plus retries.
                *attempts += 1;
                for d in 1..=self.scale.districts {
                    let mut executions = 0u64;
                    cluster.txn(m, |tx| {
                        executions += 1;
                        ready(self.deliver(tx, &i, d))
                    })?;
                    *attempts += executions - 1;
                }
                Ok(Outcome::Committed)
            }
            Inputs::StockLevel(i) => {
                *attempts += 1;
                ready(self.stock_level(&Blocking(cluster), m, &i))
            }
        }
    }

    /// [`Tables::run`] as one of many transactions in flight on `pipeline`'s thread.
    pub async fn run_in(
        &self,
        pipeline: &Pipeline<'_>,
        m: Option<MachineId>,
        (kind, w): (Kind, u32),
        rng: &mut Rand,
        now: u64,
        attempts: &mut u64,
    ) -> Result<Outcome, TxError> {
        let m = m.unwrap_or(self.machine_of_among(pipeline.machines(), w));
        let count = |attempts: &mut u64| *attempts += 1;
        match self.inputs(kind, w, rng, now) {
            Inputs::NewOrder(i) => new_order_outcome(
                pipeline
                    .txn(m, async |tx| {
                        count(attempts);
                        self.new_order(tx, &i).await
                    })
                    .await,
            ),
            Inputs::Payment(i) => {
                pipeline
                    .txn(m, async |tx| {
                        count(attempts);
                        self.payment(tx, &i).await
                    })
                    .await
            }
            Inputs::OrderStatus(i) => {
                pipeline
                    .txn(m, async |tx| {
                        count(attempts);
                        self.order_status(tx, &i).await
                    })
                    .await
            }
            Inputs::Delivery(i) => {
                *attempts += 1;
                for d in 1..=self.scale.districts {
                    let mut executions = 0u64;
                    pipeline
                        .txn(m, async |tx| {
                            executions += 1;
                            self.deliver(tx, &i, d).await
                        })
                        .await?;
                    *attempts += executions - 1;
                }
                Ok(Outcome::Committed)
            }
            Inputs::StockLevel(i) => {
                *attempts += 1;
                self.stock_level(pipeline, m, &i).await
            }
        }
    }

    /// The inputs of a transaction of `kind` for home warehouse `w`, drawn from `rng`.
    fn inputs(&self, kind: Kind, w: u32, rng: &mut Rand, now: u64) -> Inputs {
        let s = self.scale;
        let d = rng.range(1, s.districts as u64) as u8;
        match kind {
            Kind::NewOrder => {
                let c = self.customer_id(rng);
                let n = rng.range(5, 15) as usize;
                let rollback = rng.range(1, 100) == 1;
                let lines = (0..n)
                    .map(|i| {
                        let mut item = nurand(
                            rng,
                            crate::tpcc_input::A_OL_I_ID,
                            self.constants.ol_i_id,
                            1,
                            s.items as u64,
                        ) as u32;
                        if rollback && i == n - 1 {
                            item = s.items + 1; // Unused: the transaction rolls back.
                        }
                        let supply = if rng.range(1, 100) == 1 {
                            self.remote_warehouse(w, rng)
                        } else {
                            w
                        };
                        (item, supply, rng.range(1, 10) as u32)
                    })
                    .collect();
                Inputs::NewOrder(NewOrderIn {
                    w,
                    d,
                    c,
                    lines,
                    now,
                })
            }
            Kind::Payment => {
                let (c_w, c_d) = if rng.range(1, 100) <= 85 {
                    (w, d)
                } else {
                    (
                        self.remote_warehouse(w, rng),
                        rng.range(1, s.districts as u64) as u8,
                    )
                };
                let (by_name, id) = self.customer_choice(rng);
                Inputs::Payment(PaymentIn {
                    w,
                    d,
                    c_w,
                    c_d,
                    by_name,
                    id,
                    amount: rng.range(100, 500_000) as i64,
                    seq: rng.next_u64(),
                    now,
                })
            }
            Kind::OrderStatus => {
                let (by_name, id) = self.customer_choice(rng);
                Inputs::OrderStatus(OrderStatusIn { w, d, by_name, id })
            }
            Kind::Delivery => Inputs::Delivery(DeliveryIn {
                w,
                carrier: rng.range(1, 10) as u8,
                now,
            }),
            Kind::StockLevel => Inputs::StockLevel(StockLevelIn {
                w,
                d,
                threshold: rng.range(10, 20) as u32,
            }),
        }
    }

    fn customer_id(&self, rng: &mut Rand) -> u32 {
        nurand(
            rng,
            crate::tpcc_input::A_C_ID,
            self.constants.c_id,
            1,
            self.scale.customers as u64,
        ) as u32
    }

    /// Another warehouse than `w`, when there is one.
    fn remote_warehouse(&self, w: u32, rng: &mut Rand) -> u32 {
        if self.scale.warehouses == 1 {
            return w;
        }
        let other = rng.range(1, self.scale.warehouses as u64 - 1) as u32;
        if other >= w {
            other + 1
        } else {
            other
        }
    }

    /// NEW-ORDER (clause 2.4.2) in `tx`.
    async fn new_order(&self, tx: &mut impl Transaction, i: &NewOrderIn) -> Result<(), TxError> {
        let NewOrderIn {
            w,
            d,
            c,
            ref lines,
            now,
        } = *i;
        let n = lines.len();
        let all_local = lines.iter().all(|(_, sw, _)| *sw == w) as u8;
        // Every row's key is known up front: start all the fetches before the first read.
        self.warehouse.prefetch(tx, &w);
        self.district.prefetch(tx, &d_key(w, d));
        self.customer.prefetch(tx, &c_key(w, d, c));
        // The warehouse's machine's copy (the machine of its WAREHOUSE row).
        let copy = self.warehouse.partition_of(&w);
        for &(item_id, supply, _) in lines {
            self.item.prefetch(tx, &i_key(copy, item_id));
            self.stock.prefetch(tx, &s_key(supply, item_id));
        }
        // W_TAX and C_DISCOUNT are read for the total the terminal shows (clause 2.4.2.2),
        // which nothing stores.
        self.warehouse
            .get_in_async(tx, &w)
            .await?
            .ok_or_else(|| tx.abort("no warehouse"))?;
        let mut district = self
            .district
            .get_in_async(tx, &d_key(w, d))
            .await?
            .ok_or_else(|| tx.abort("no district"))?;
        self.customer
            .get_in_async(tx, &c_key(w, d, c))
            .await?
            .ok_or_else(|| tx.abort("no customer"))?;
        let o = district.next_o_id;
        district.next_o_id += 1;
        self.district
            .update_async(tx, &d_key(w, d), &district)
            .await?;
        let order = Order {
            entry_d: now,
            c_id: c,
            carrier_id: 0,
            ol_cnt: n as u8,
            all_local,
            _pad: 0,
        };
        self.order.insert_async(tx, &o_key(w, d, o), &order).await?;
        self.new_order
            .of(w)
            .insert_async(tx, &o_key(w, d, o), &0)
            .await?;
        self.order_by_customer
            .of(w)
            .insert_async(tx, &co_key(w, d, c, o), &0)
            .await?;
        let mut rows = OrderLines::zeroed();
        for (i, &(item_id, supply, qty)) in lines.iter().enumerate() {
            let Some(item) = self.item.get_in_async(tx, &i_key(copy, item_id)).await? else {
                return Err(tx.abort(ROLLBACK));
            };
            let key = s_key(supply, item_id);
            let mut stock = self
                .stock
                .get_in_async(tx, &key)
                .await?
                .ok_or_else(|| tx.abort("no stock"))?;
            stock.quantity = if stock.quantity >= qty + 10 {
                stock.quantity - qty
            } else {
                stock.quantity + 91 - qty
            };
            stock.ytd += qty as u64;
            stock.order_cnt += 1;
            stock.remote_cnt += (supply != w) as u32;
            self.stock.update_async(tx, &key, &stock).await?;
            let amount = qty as i64 * item.price;
            rows.lines[i] = OrderLine {
                delivery_d: 0,
                amount,
                i_id: item_id,
                supply_w_id: supply,
                quantity: qty,
                dist_info: stock.dist[d as usize - 1],
                _pad: [0; 4],
            };
        }
        rows.count = n as u8;
        self.order_line
            .insert_async(tx, &o_key(w, d, o), &rows)
            .await?;
        Ok(())
    }

    /// The customer a PAYMENT or ORDER-STATUS names: by id (40%) or by last name (60%, the
    /// middle one of those with the name in first-name order, clause 2.5.2.2).
    async fn pick_customer(
        &self,
        tx: &mut impl Transaction,
        w: u32,
        d: u8,
        by_name: Option<[u8; 16]>,
        id: u32,
    ) -> Result<Option<u32>, TxError> {
        let Some(last) = by_name else {
            return Ok(Some(id));
        };
        let from = name_key(w, d, &last, &[0; 16], 0);
        let mut to_last = last;
        // Names are zero-padded: the next name after `last` starts with its prefix and a byte
        // above zero at its end, so bump the padding.
        let end = to_last.iter().position(|b| *b == 0).unwrap_or(16);
        if end < 16 {
            to_last[end] = 1;
        } else {
            to_last[15] = to_last[15].saturating_add(1);
        }
        let to = name_key(w, d, &to_last, &[0; 16], 0);
        let found = self
            .customer_by_name
            .of(w)
            .range_async(tx, &from, Some(&to), usize::MAX)
            .await?;
        if found.is_empty() {
            return Ok(None);
        }
        Ok(Some(found[(found.len() - 1) / 2].1))
    }

    fn customer_choice(&self, rng: &mut Rand) -> (Option<[u8; 16]>, u32) {
        if rng.range(1, 100) <= 60 {
            let n = nurand(rng, A_C_LAST, self.constants.c_last_run, 0, 999);
            let n = n.min(self.scale.customers.min(1000) as u64 - 1);
            (Some(last_name(n)), 0)
        } else {
            (None, self.customer_id(rng))
        }
    }

    /// PAYMENT (clause 2.5.2) in `tx`.
    async fn payment(&self, tx: &mut impl Transaction, i: &PaymentIn) -> Result<Outcome, TxError> {
        let PaymentIn {
            w,
            d,
            c_w,
            c_d,
            by_name,
            id,
            amount,
            seq,
            now,
        } = *i;
        self.warehouse.prefetch(tx, &w);
        self.district.prefetch(tx, &d_key(w, d));
        if by_name.is_none() {
            self.customer.prefetch(tx, &c_key(c_w, c_d, id));
        }
        let mut warehouse = self
            .warehouse
            .get_in_async(tx, &w)
            .await?
            .ok_or_else(|| tx.abort("no warehouse"))?;
        warehouse.ytd += amount;
        self.warehouse.update_async(tx, &w, &warehouse).await?;
        let mut district = self
            .district
            .get_in_async(tx, &d_key(w, d))
            .await?
            .ok_or_else(|| tx.abort("no district"))?;
        district.ytd += amount;
        self.district
            .update_async(tx, &d_key(w, d), &district)
            .await?;
        let c = self
            .pick_customer(tx, c_w, c_d, by_name, id)
            .await?
            .ok_or_else(|| tx.abort("no customer of that name"))?;
        let key = c_key(c_w, c_d, c);
        let mut customer = self
            .customer
            .get_in_async(tx, &key)
            .await?
            .ok_or_else(|| tx.abort("no customer"))?;
        customer.balance -= amount;
        customer.ytd_payment += amount;
        customer.payment_cnt += 1;
        if &customer.credit == b"BC" {
            let note = format!("{c} {c_d} {c_w} {d} {w} {amount} ");
            let mut data = [0u8; 500];
            let n = note.len().min(500);
            data[..n].copy_from_slice(&note.as_bytes()[..n]);
            data[n..].copy_from_slice(&customer.data[..500 - n]);
            customer.data = data;
        }
        self.customer.update_async(tx, &key, &customer).await?;
        let h = History {
            amount,
            date: now,
            c_w_id: c_w,
            w_id: w,
            c_id: c,
            c_d_id: c_d,
            d_id: d,
            data: [b'p'; 24],
            _pad: [0; 2],
        };
        // A unique id: the district's and a random 39-bit number (population rows use the
        // customer ids, below 2^39).
        if !self
            .history
            .insert_async(tx, &h_key(w, d, 1 << 39 | seq >> 25), &h)
            .await?
        {
            return Err(tx.abort("a history id came up twice"));
        }
        Ok(Outcome::Committed)
    }

    /// ORDER-STATUS (clause 2.6.2) in `tx`.
    async fn order_status(
        &self,
        tx: &mut impl Transaction,
        i: &OrderStatusIn,
    ) -> Result<Outcome, TxError> {
        let OrderStatusIn { w, d, by_name, id } = *i;
        let c = self
            .pick_customer(tx, w, d, by_name, id)
            .await?
            .ok_or_else(|| tx.abort("no customer of that name"))?;
        self.customer
            .get_in_async(tx, &c_key(w, d, c))
            .await?
            .ok_or_else(|| tx.abort("no customer"))?;
        let from = co_key(w, d, c, 0);
        let to = co_key(w, d, c + 1, 0);
        let orders = self
            .order_by_customer
            .of(w)
            .range_async(tx, &from, Some(&to), usize::MAX)
            .await?;
        if let Some((key, _)) = orders.last() {
            let o = (key & 0xff_ffff) as u32;
            let order = self
                .order
                .get_in_async(tx, &o_key(w, d, o))
                .await?
                .ok_or_else(|| tx.abort("no order"))?;
            let lines = self
                .order_line
                .get_in_async(tx, &o_key(w, d, o))
                .await?
                .ok_or_else(|| tx.abort("no order lines"))?;
            if lines.present().len() != order.ol_cnt as usize {
                return Err(tx.abort("O_OL_CNT differs from the order's lines"));
            }
        }
        Ok(Outcome::Committed)
    }

    /// DELIVERY (clause 2.7.4) of district `d`'s oldest undelivered order, in `tx`.
    async fn deliver(
        &self,
        tx: &mut impl Transaction,
        i: &DeliveryIn,
        d: u8,
    ) -> Result<(), TxError> {
        let DeliveryIn { w, carrier, now } = *i;
        let oldest = self
            .new_order
            .of(w)
            .range_async(tx, &o_key(w, d, 0), Some(&o_key(w, d + 1, 0)), 1)
            .await?;
        let Some(&(key, _)) = oldest.first() else {
            return Ok(()); // No undelivered order in this district.
        };
        self.new_order.of(w).remove_async(tx, &key).await?;
        let mut order = self
            .order
            .get_in_async(tx, &key)
            .await?
            .ok_or_else(|| tx.abort("no order"))?;
        order.carrier_id = carrier;
        self.order.update_async(tx, &key, &order).await?;
        let mut lines = self
            .order_line
            .get_in_async(tx, &key)
            .await?
            .ok_or_else(|| tx.abort("no order lines"))?;
        let mut total = 0;
        for line in lines.present_mut() {
            line.delivery_d = now;
            total += line.amount;
        }
        self.order_line.update_async(tx, &key, &lines).await?;
        let ck = c_key(w, d, order.c_id);
        let mut customer = self
            .customer
            .get_in_async(tx, &ck)
            .await?
            .ok_or_else(|| tx.abort("no customer"))?;
        customer.balance += total;
        customer.delivery_cnt += 1;
        self.customer.update_async(tx, &ck, &customer).await?;
        Ok(())
    }

    /// STOCK-LEVEL (clause 2.8.2). Level 1 isolation (clause 3.4.1): every row read is
    /// committed, each on its own, so lock-free reads; no transaction, no validation, nothing
    /// to abort.
    async fn stock_level(
        &self,
        reads: &impl LockFree,
        m: MachineId,
        i: &StockLevelIn,
    ) -> Result<Outcome, TxError> {
        let StockLevelIn { w, d, threshold } = *i;
        let district = reads
            .get(&self.district, m, &d_key(w, d))
            .await?
            .ok_or_else(|| TxError::Aborted("no district".into()))?;
        let next = district.next_o_id;
        let mut items = std::collections::BTreeSet::new();
        for o in next.saturating_sub(20).max(1)..next {
            // Orders below the committed D_NEXT_O_ID committed with their lines.
            let lines = reads
                .get(&self.order_line, m, &o_key(w, d, o))
                .await?
                .ok_or_else(|| TxError::Aborted(format!("order {o} has no lines")))?;
            items.extend(lines.present().iter().map(|l| l.i_id));
        }
        let mut low = 0;
        for i in items {
            if let Some(stock) = reads.get(&self.stock, m, &s_key(w, i)).await? {
                low += (stock.quantity < threshold) as u32;
            }
        }
        let _ = low; // What the terminal shows.
        Ok(Outcome::Committed)
    }
}

/// The abort reason of the specification's NEW-ORDER rollbacks.
const ROLLBACK: &str = "Item number is not valid";
