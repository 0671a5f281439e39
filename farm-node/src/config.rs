//! Settings of a machine process and of the local launcher: a TOML file (`--config`) whose keys
//! are the flags' names with `_` for `-`, overridden by flags, with defaults for what neither
//! gives. Unknown keys, bad values and missing files fail with a message that names them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use farm::node::{NodeConfig, Secret, Transport};
use farm::MachineId;
use serde::{Deserialize, Serialize};

/// Every setting, each optional: as flags and as keys of the TOML file.
#[derive(clap::Args, Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct Overrides {
    /// The cluster's name: its ZooKeeper znode is `/farm/<name>`, and datagrams and NVRAM
    /// directories of other clusters are refused [default: farm].
    #[arg(long)]
    pub cluster: Option<String>,
    /// The cluster's NVRAM directory, shared by its machine processes [default:
    /// farm-data/<cluster>].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Machines of the first configuration [default: 3].
    #[arg(long)]
    pub machines: Option<u16>,
    /// Worker threads per machine [default: 2].
    #[arg(long)]
    pub workers: Option<u16>,
    /// UDP port of machine 0 on loopback; machine m uses base_port + m [default: 7400].
    #[arg(long)]
    pub base_port: Option<u16>,
    /// Lease length in milliseconds (failure detection, FaRM §5.1) [default: 100: on a
    /// shared two-core VM, loading TPC-C stalls whole processes for up to 50 ms].
    #[arg(long)]
    pub lease_ms: Option<u64>,
    /// Regions each machine is primary of at first [default: 1].
    #[arg(long)]
    pub regions_per_machine: Option<u32>,
    /// Replicas of each region, primary included [default: 3, at most the machines].
    #[arg(long)]
    pub replicas: Option<u16>,
    /// Region size in MiB [default: 64].
    #[arg(long)]
    pub region_mb: Option<usize>,
    /// The ZooKeeper ensemble, `host:port[,host:port...]` [default: 127.0.0.1:2181].
    #[arg(long)]
    pub zookeeper: Option<String>,
    /// Seconds between statistics lines in the log [default: 5].
    #[arg(long)]
    pub stats_seconds: Option<u64>,
    /// Seconds to wait at start for the other machines [default: 30].
    #[arg(long)]
    pub start_timeout_seconds: Option<u64>,
    /// How the machines reach each other: `shm` (processes of one host map each other's NVRAM
    /// files) or `tcp` (hosts; see `hosts`) [default: shm].
    #[arg(long)]
    pub fabric: Option<String>,
    /// With `fabric = "tcp"`: every machine's address, `ip:port`, machine 0 first; it listens
    /// there for one-sided operations (TCP) and datagrams (UDP) [default: 127.0.0.1 at
    /// base_port + m].
    #[arg(long, value_delimiter = ',')]
    pub hosts: Option<Vec<String>>,
    /// With `fabric = "tcp"`: milliseconds a one-sided operation waits for its answer before
    /// the peer counts as unreachable [default: 4 leases, at least 200].
    #[arg(long)]
    pub tcp_timeout_ms: Option<u64>,
    /// For the launcher: run machine m's process in the network namespace `<netns><m>`
    /// (`ip netns exec`), as a host of its own.
    #[arg(long)]
    pub netns: Option<String>,
    /// Serve Prometheus metrics over HTTP (`GET /metrics`, the OpenMetrics text format):
    /// `ip:port` of machine 0, machine m at port + m [default: off].
    #[arg(long)]
    pub metrics_addr: Option<String>,
    /// For the launcher: the machine program to start, `<program> --machine M <settings>`
    /// (a program of your own built on `farm_node::run`, such as `examples/bank.rs`) instead
    /// of `farm-node run --machine M <settings>` [default: farm-node itself].
    #[arg(long)]
    pub program: Option<PathBuf>,
    /// The cluster's shared secret: a file readable by its owner only, the same on every
    /// host (peers prove it to each other before any one-sided operation, and tag every
    /// datagram with it) [default: <dir>/secret; `local start` makes it when absent].
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// With a whole-cluster restart (`--restart`): seconds the machines wait for every machine
    /// before the lowest that came back restarts without those that did not (a machine whose
    /// disk died, machine 0 included),
    /// if every region keeps a complete replica among the machines that did and they are a
    /// majority of the members; otherwise it goes on waiting, and says why [default: off,
    /// every machine is waited for].
    #[arg(long)]
    pub restart_without_seconds: Option<u64>,
}

impl Overrides {
    /// `self`'s settings, and `other`'s where `self` has none.
    fn or(self, other: Overrides) -> Overrides {
        Overrides {
            cluster: self.cluster.or(other.cluster),
            dir: self.dir.or(other.dir),
            machines: self.machines.or(other.machines),
            workers: self.workers.or(other.workers),
            base_port: self.base_port.or(other.base_port),
            lease_ms: self.lease_ms.or(other.lease_ms),
            regions_per_machine: self.regions_per_machine.or(other.regions_per_machine),
            replicas: self.replicas.or(other.replicas),
            region_mb: self.region_mb.or(other.region_mb),
            zookeeper: self.zookeeper.or(other.zookeeper),
            stats_seconds: self.stats_seconds.or(other.stats_seconds),
            start_timeout_seconds: self.start_timeout_seconds.or(other.start_timeout_seconds),
            fabric: self.fabric.or(other.fabric),
            hosts: self.hosts.or(other.hosts),
            tcp_timeout_ms: self.tcp_timeout_ms.or(other.tcp_timeout_ms),
            netns: self.netns.or(other.netns),
            program: self.program.or(other.program),
            metrics_addr: self.metrics_addr.or(other.metrics_addr),
            secret_file: self.secret_file.or(other.secret_file),
            restart_without_seconds: self
                .restart_without_seconds
                .or(other.restart_without_seconds),
        }
    }
}

/// The configuration file and the flags that override it.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ConfigArgs {
    /// A TOML file of settings (keys as the flags below, `lease_ms = 50`); flags win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub overrides: Overrides,
}

/// The settings in force.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub cluster: String,
    pub dir: PathBuf,
    pub machines: u16,
    pub workers: u16,
    pub base_port: u16,
    pub lease_ms: u64,
    pub regions_per_machine: u32,
    pub replicas: u16,
    pub region_mb: usize,
    pub zookeeper: String,
    pub stats_seconds: u64,
    pub start_timeout_seconds: u64,
    /// `shm` or `tcp`.
    pub fabric: String,
    /// Every machine's address (`tcp`; empty for `shm`).
    pub hosts: Vec<std::net::SocketAddr>,
    pub tcp_timeout_ms: u64,
    pub netns: Option<String>,
    pub program: Option<PathBuf>,
    /// Where machine 0 serves its metrics; machine m at port + m.
    pub metrics_addr: Option<std::net::SocketAddr>,
    pub secret_file: PathBuf,
    pub restart_without_seconds: Option<u64>,
}

impl ConfigArgs {
    /// The settings: flags, then the file, then defaults; checked.
    pub fn resolve(&self) -> anyhow::Result<Settings> {
        let file = match &self.config {
            Some(path) => read_file(path)?,
            None => Overrides::default(),
        };
        let o = self.overrides.clone().or(file);
        let cluster = o.cluster.unwrap_or_else(|| "farm".into());
        let machines = o.machines.unwrap_or(3);
        let base_port = o.base_port.unwrap_or(7400);
        let lease_ms = o.lease_ms.unwrap_or(100);
        let fabric = o.fabric.unwrap_or_else(|| "shm".into());
        let hosts = match (fabric.as_str(), o.hosts) {
            ("tcp", Some(hosts)) => hosts
                .iter()
                .map(|h| {
                    h.trim().parse().map_err(|e| {
                        anyhow::anyhow!("hosts: {h:?} is not an address `ip:port` ({e})")
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
            ("tcp", None) => (0..machines)
                .map(|m| std::net::SocketAddr::from(([127, 0, 0, 1], base_port.saturating_add(m))))
                .collect(),
            ("shm", None) => Vec::new(),
            ("shm", Some(_)) => {
                bail!("hosts are for fabric = \"tcp\"; the shm fabric runs on one host")
            }
            (other, _) => bail!("fabric = {other:?}: `shm` (one host) or `tcp` (hosts)"),
        };
        let dir = o
            .dir
            .unwrap_or_else(|| Path::new("farm-data").join(&cluster));
        let s = Settings {
            secret_file: o.secret_file.unwrap_or_else(|| dir.join("secret")),
            dir,
            cluster,
            machines,
            workers: o.workers.unwrap_or(2),
            base_port,
            lease_ms,
            regions_per_machine: o.regions_per_machine.unwrap_or(1),
            replicas: o.replicas.unwrap_or(3.min(machines)),
            region_mb: o.region_mb.unwrap_or(64),
            zookeeper: o.zookeeper.unwrap_or_else(|| "127.0.0.1:2181".into()),
            stats_seconds: o.stats_seconds.unwrap_or(5),
            start_timeout_seconds: o.start_timeout_seconds.unwrap_or(30),
            fabric,
            hosts,
            tcp_timeout_ms: o.tcp_timeout_ms.unwrap_or_else(|| (4 * lease_ms).max(200)),
            netns: o.netns,
            program: o.program,
            metrics_addr: match o.metrics_addr {
                Some(a) => Some(a.trim().parse().map_err(|e| {
                    anyhow::anyhow!("metrics_addr: {a:?} is not an address `ip:port` ({e})")
                })?),
                None => None,
            },
            restart_without_seconds: o.restart_without_seconds,
        };
        s.check()?;
        Ok(s)
    }
}

fn read_file(path: &Path) -> anyhow::Result<Overrides> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the configuration file {}", path.display()))?;
    toml::from_str(&text).map_err(|e| {
        anyhow::anyhow!(
            "configuration file {}: {}",
            path.display(),
            e.to_string().trim_end()
        )
    })
}

impl Settings {
    fn check(&self) -> anyhow::Result<()> {
        let name_ok = !self.cluster.is_empty()
            && self
                .cluster
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !name_ok {
            bail!(
                "cluster name {:?}: use letters, digits, '-' and '_' (it names a znode)",
                self.cluster
            );
        }
        if let Some(t) = self.restart_without_seconds {
            if t >= self.start_timeout_seconds {
                bail!(
                    "restart_without_seconds = {t}: a restart fails after start_timeout_seconds \
                     = {}, so it must be shorter",
                    self.start_timeout_seconds
                );
            }
        }
        if self.machines == 0 {
            bail!("machines = 0: a cluster needs at least one machine");
        }
        if self.replicas == 0 || self.replicas > self.machines {
            bail!(
                "replicas = {}: between 1 and the {} machines",
                self.replicas,
                self.machines
            );
        }
        if self.workers == 0 {
            bail!("workers = 0: a machine needs at least one worker thread");
        }
        if self.lease_ms == 0 {
            bail!("lease_ms = 0: leases need at least 1 ms");
        }
        if self.region_mb == 0 || self.region_mb > 4096 {
            bail!("region_mb = {}: between 1 and 4096", self.region_mb);
        }
        if let Some(a) = self.metrics_addr {
            if a.port() as u32 + self.machines as u32 > u16::MAX as u32 {
                bail!(
                    "metrics_addr = {a}: machines up to {} need ports past 65535",
                    self.machines
                );
            }
        }
        if self.base_port as u32 + self.machines as u32 > u16::MAX as u32 {
            bail!(
                "base_port = {}: machines up to {} need ports past 65535",
                self.base_port,
                self.machines
            );
        }
        if self.stats_seconds == 0 {
            bail!("stats_seconds = 0: at least 1");
        }
        if self.fabric == "tcp" && self.hosts.len() != self.machines as usize {
            bail!(
                "hosts: {} addresses for {} machines: one per machine, machine 0 first",
                self.hosts.len(),
                self.machines
            );
        }
        if self.tcp_timeout_ms == 0 {
            bail!("tcp_timeout_ms = 0: at least 1");
        }
        if let Some(ns) = &self.netns {
            if ns.is_empty()
                || !ns
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                bail!("netns = {ns:?}: use letters, digits, '-' and '_' (it prefixes namespace names)");
            }
        }
        Ok(())
    }

    /// These settings as a TOML file of [`Overrides`] (what `local start` leaves in the
    /// cluster's directory for later commands).
    pub fn to_toml(&self) -> String {
        format!(
            "cluster = {:?}\ndir = {:?}\nmachines = {}\nworkers = {}\nbase_port = {}\n\
             lease_ms = {}\nregions_per_machine = {}\nreplicas = {}\nregion_mb = {}\n\
             zookeeper = {:?}\nstats_seconds = {}\nstart_timeout_seconds = {}\nfabric = {:?}\n\
             tcp_timeout_ms = {}\nsecret_file = {:?}\n{}{}{}{}{}",
            self.cluster,
            self.dir.display().to_string(),
            self.machines,
            self.workers,
            self.base_port,
            self.lease_ms,
            self.regions_per_machine,
            self.replicas,
            self.region_mb,
            self.zookeeper,
            self.stats_seconds,
            self.start_timeout_seconds,
            self.fabric,
            self.tcp_timeout_ms,
            self.secret_file.display().to_string(),
            if self.fabric == "tcp" {
                let hosts: Vec<String> = self
                    .hosts
                    .iter()
                    .map(|h| format!("{:?}", h.to_string()))
                    .collect();
                format!("hosts = [{}]\n", hosts.join(", "))
            } else {
                String::new()
            },
            self.netns
                .as_ref()
                .map_or(String::new(), |ns| format!("netns = {ns:?}\n")),
            self.program.as_ref().map_or(String::new(), |p| format!(
                "program = {:?}\n",
                p.display().to_string()
            )),
            self.metrics_addr.map_or(String::new(), |a| format!(
                "metrics_addr = {:?}\n",
                a.to_string()
            )),
            self.restart_without_seconds
                .map_or(String::new(), |t| format!(
                    "restart_without_seconds = {t}\n"
                )),
        )
    }

    /// Where machine `m` serves its metrics, if it does: `metrics_addr` with port + m.
    pub fn metrics_addr_of(&self, m: u16) -> Option<std::net::SocketAddr> {
        self.metrics_addr.map(|mut a| {
            a.set_port(a.port() + m);
            a
        })
    }

    /// A connection to the cluster's node in ZooKeeper, for what its processes share besides
    /// the configuration (`ZkStore::put` and `get`: a workload's table roots, say).
    pub fn store(&self) -> anyhow::Result<farm::zk::ZkStore> {
        farm::zk::ZkStore::connect(&self.zookeeper, &self.root(), Duration::from_secs(10))
            .with_context(|| format!("connecting to ZooKeeper at {}", self.zookeeper))
    }

    /// The cluster's znode in ZooKeeper.
    pub fn root(&self) -> String {
        format!("/farm/{}", self.cluster)
    }

    /// The cluster's id on the wire and on disk: a hash of its name (FNV-1a).
    pub fn cluster_id(&self) -> u64 {
        self.cluster.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    /// How machine `machine`'s process runs: the settings, with the cluster's secret read from
    /// `secret_file`.
    pub fn node_config(
        &self,
        machine: u16,
        restart: bool,
        join: bool,
    ) -> anyhow::Result<NodeConfig> {
        let secret = Secret::load(&self.secret_file).with_context(|| {
            format!(
                "the cluster's secret: copy it to {} on this host (`farm-node local start` \
                 makes one), or name its file with secret_file",
                self.secret_file.display()
            )
        })?;
        Ok(NodeConfig {
            secret,
            dir: self.dir.clone(),
            cluster: self.cluster_id(),
            machine: MachineId(machine),
            machines: self.machines,
            workers: self.workers,
            base_port: self.base_port,
            lease: Duration::from_millis(self.lease_ms),
            start_timeout: Duration::from_secs(self.start_timeout_seconds),
            regions_per_machine: self.regions_per_machine,
            replicas: self.replicas,
            region_bytes: self.region_mb << 20,
            zookeeper: Some((self.zookeeper.clone(), self.root())),
            restart,
            restart_without_after: self.restart_without_seconds.map(Duration::from_secs),
            join,
            transport: if self.fabric == "tcp" {
                Transport::Tcp {
                    addrs: self.hosts.clone(),
                    timeout: Duration::from_millis(self.tcp_timeout_ms),
                }
            } else {
                Transport::Shm
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(file: Option<&str>, overrides: Overrides) -> (ConfigArgs, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let config = file.map(|text| {
            let path = dir.path().join("node.toml");
            std::fs::write(&path, text).unwrap();
            path
        });
        (ConfigArgs { config, overrides }, dir)
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let (a, _d) = args(
            Some("cluster = \"bank\"\nmachines = 5\nlease_ms = 20\n"),
            Overrides {
                lease_ms: Some(30),
                ..Overrides::default()
            },
        );
        let s = a.resolve().unwrap();
        assert_eq!(
            (s.cluster.as_str(), s.machines, s.lease_ms),
            ("bank", 5, 30)
        );
        assert_eq!(s.dir, Path::new("farm-data/bank"));
        assert_eq!(s.replicas, 3);
        assert_eq!(s.root(), "/farm/bank");
        assert_eq!(s.secret_file, Path::new("farm-data/bank/secret"));
        let keys = tempfile::tempdir().unwrap();
        let missing = Settings {
            secret_file: keys.path().join("secret"),
            ..s.clone()
        };
        let err = format!("{:#}", missing.node_config(4, false, true).unwrap_err());
        assert!(
            err.contains("the cluster's secret") && err.contains("local start"),
            "{err}"
        );
        Secret::generate(&missing.secret_file).unwrap();
        let n = missing.node_config(4, false, true).unwrap();
        assert_eq!(n.machine, MachineId(4));
        assert!(n.join && !n.restart);
        assert_eq!(n.lease, Duration::from_millis(30));
    }

    #[test]
    fn bad_settings_fail_naming_what_is_wrong() {
        let cases: [(&str, Overrides, &str); 11] = [
            (
                "lease = 20\n",
                Overrides::default(),
                "unknown field `lease`",
            ),
            ("machines = \"three\"\n", Overrides::default(), "machines"),
            (
                "",
                Overrides {
                    replicas: Some(4),
                    ..Overrides::default()
                },
                "replicas = 4: between 1 and the 3 machines",
            ),
            (
                "cluster = \"a/b\"\n",
                Overrides::default(),
                "cluster name \"a/b\"",
            ),
            ("workers = 0\n", Overrides::default(), "workers = 0"),
            (
                "fabric = \"rdma\"\n",
                Overrides::default(),
                "fabric = \"rdma\"",
            ),
            (
                "fabric = \"tcp\"\nhosts = [\"10.0.0.1:7400\", \"10.0.0.2\"]\n",
                Overrides::default(),
                "\"10.0.0.2\" is not an address",
            ),
            (
                "fabric = \"tcp\"\nhosts = [\"10.0.0.1:7400\"]\n",
                Overrides::default(),
                "1 addresses for 3 machines",
            ),
            (
                "hosts = [\"10.0.0.1:7400\"]\n",
                Overrides::default(),
                "hosts are for fabric = \"tcp\"",
            ),
            ("netns = \"a b\"\n", Overrides::default(), "netns = \"a b\""),
            (
                "metrics_addr = \"9400\"\n",
                Overrides::default(),
                "metrics_addr: \"9400\" is not an address",
            ),
        ];
        for (file, overrides, expected) in cases {
            let (a, _d) = args(Some(file), overrides);
            let e = format!("{:#}", a.resolve().unwrap_err());
            assert!(e.contains(expected), "{file:?}: {e}");
        }
        let missing = ConfigArgs {
            config: Some("/nonexistent/node.toml".into()),
            overrides: Overrides::default(),
        };
        let e = format!("{:#}", missing.resolve().unwrap_err());
        assert!(e.contains("/nonexistent/node.toml"), "{e}");
    }

    #[test]
    fn settings_written_as_toml_read_back_the_same() {
        let (a, d) = args(
            Some(
                "cluster = \"x-1\"\ndir = \"/tmp/a b\"\nregion_mb = 8\nprogram = \"/opt/my app\"\n\
                 metrics_addr = \"127.0.0.1:9400\"\n",
            ),
            Overrides::default(),
        );
        let s = a.resolve().unwrap();
        let saved = d.path().join("saved.toml");
        std::fs::write(&saved, s.to_toml()).unwrap();
        let again = ConfigArgs {
            config: Some(saved),
            overrides: Overrides::default(),
        };
        assert_eq!(again.resolve().unwrap(), s);
    }

    #[test]
    fn tcp_settings_name_every_host_and_read_back_the_same() {
        let (a, d) = args(
            Some("fabric = \"tcp\"\nnetns = \"farm-h\"\nlease_ms = 100\n"),
            Overrides {
                hosts: Some(vec![
                    "10.0.0.1:7400".into(),
                    "10.0.0.2:7400".into(),
                    "10.0.0.3:7400".into(),
                ]),
                ..Overrides::default()
            },
        );
        let s = a.resolve().unwrap();
        assert_eq!(s.tcp_timeout_ms, 400, "4 leases");
        let keys = tempfile::tempdir().unwrap();
        let s = Settings {
            secret_file: keys.path().join("secret"),
            ..s
        };
        Secret::generate(&s.secret_file).unwrap();
        match s.node_config(2, false, false).unwrap().transport {
            Transport::Tcp { addrs, timeout } => {
                assert_eq!(addrs[2], "10.0.0.3:7400".parse().unwrap());
                assert_eq!(timeout, Duration::from_millis(400));
            }
            Transport::Shm => panic!("fabric = tcp ran on shm"),
        }
        let saved = d.path().join("saved.toml");
        std::fs::write(&saved, s.to_toml()).unwrap();
        let again = ConfigArgs {
            config: Some(saved),
            overrides: Overrides::default(),
        };
        assert_eq!(again.resolve().unwrap(), s);
        // Without hosts, the machines listen on loopback at the base port on.
        let (a, _d) = args(
            Some("fabric = \"tcp\"\nbase_port = 9000\n"),
            Overrides::default(),
        );
        let s = a.resolve().unwrap();
        assert_eq!(s.hosts[1], "127.0.0.1:9001".parse().unwrap());
    }

    #[test]
    fn cluster_ids_differ_by_name() {
        let id = |name: &str| {
            let (a, _d) = args(
                None,
                Overrides {
                    cluster: Some(name.into()),
                    ..Overrides::default()
                },
            );
            a.resolve().unwrap().cluster_id()
        };
        assert_ne!(id("a"), id("b"));
        assert_eq!(id("a"), id("a"));
    }
}
