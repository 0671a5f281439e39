//! A machine of a farm-rs cluster as a process of your own program: the settings every machine
//! process takes ([`config`]: flags, a TOML file, defaults, checked) and [`run`], which starts
//! the machine (or restarts it from NVRAM, or joins it to a running cluster), runs your code on
//! it beside the serving loop, starts it again as a new incarnation that rejoins whenever the
//! cluster evicts it, and on a power signal (SIGTERM, SIGPWR) halts it and writes its NVRAM
//! back before it exits. `farm-node run` is such a program, with TATP and TPC-C as its code;
//! `examples/bank.rs` is another, and `farm-node local --program` runs either as a cluster on
//! one host.
//!
//! ```no_run
//! use clap::Parser;
//! use farm_node::{MachineArgs, Running};
//!
//! #[derive(Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     machine: MachineArgs,
//! }
//!
//! fn main() -> anyhow::Result<()> {
//!     let args = Args::parse();
//!     farm_node::run(&args.machine, |m: &Running<'_>| {
//!         while !m.stopping() {
//!             // m.node.txn(|tx| ...) runs a transaction coordinated on this machine.
//!             std::thread::sleep(std::time::Duration::from_millis(10));
//!         }
//!         Ok(())
//!     })
//! }
//! ```

pub mod config;
mod http;
mod machine;

/// Logs to standard error at `level` (`tracing`), the ZooKeeper client's session events at
/// warnings only: what `farm-node` does, for programs of their own.
pub fn log_to_stderr(level: tracing::Level) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::filter::Targets::new()
        .with_default(level)
        .with_target("zookeeper_client", level.min(tracing::Level::WARN));
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .init();
}

pub use config::{ConfigArgs, Settings};
pub use http::scrape;
pub use machine::{run, MachineArgs, Running};
