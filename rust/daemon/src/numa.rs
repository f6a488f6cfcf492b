//! Pinning the daemon to a NUMA node's CPUs and memory (Linux).
//!
//! Every thread the daemon starts (tokio workers, the rayon pool) is created after
//! [`apply`] ran on the main thread, and Linux threads inherit both the CPU affinity and the
//! memory policy of the thread that creates them; so pinning the main thread first pins them
//! all. The memory policy also decides where the page cache pages of the model are put when a
//! pinned thread faults them in, which is why the model is opened after [`apply`].

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{DaemonError, Result};

/// Where the daemon's threads and memory should live.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Anywhere the scheduler likes.
    #[default]
    Unpinned,
    /// On one NUMA node: its CPUs and its memory.
    Node(u32),
    /// On these CPUs (memory unconstrained).
    Cpus(Vec<usize>),
}

/// What [`apply`] did, for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    Unpinned,
    /// The machine has a single NUMA node: pinning to it would change nothing.
    SingleNode {
        node: u32,
        cpus: Vec<usize>,
    },
    Node {
        node: u32,
        cpus: Vec<usize>,
        memory_bound: bool,
    },
    Cpus(Vec<usize>),
}

impl fmt::Display for Applied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Applied::Unpinned => write!(f, "unpinned"),
            Applied::SingleNode { node, cpus } => write!(
                f,
                "no NUMA on this machine (node{node} is the only node, cpus {}): running unpinned",
                format_cpulist(cpus)
            ),
            Applied::Node {
                node,
                cpus,
                memory_bound,
            } => write!(
                f,
                "pinned to NUMA node {node}: cpus {}, memory {}",
                format_cpulist(cpus),
                if *memory_bound {
                    "bound to the node"
                } else {
                    "not bound"
                }
            ),
            Applied::Cpus(cpus) => write!(f, "pinned to cpus {}", format_cpulist(cpus)),
        }
    }
}

/// Parses a kernel CPU list such as `0-3,8,10-11` (as in `/sys/devices/system/node/node0/cpulist`
/// or `taskset -c`). `what` names the source in errors.
pub fn parse_cpulist(text: &str, what: &str) -> Result<Vec<usize>> {
    let bad = |detail: String| DaemonError::Config(format!("{what}: {detail}"));
    let mut cpus = Vec::new();
    let text = text.trim();
    if text.is_empty() {
        return Ok(cpus);
    }
    for part in text.split(',') {
        let part = part.trim();
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let parse = |s: &str| {
            s.parse::<usize>().map_err(|_| {
                bad(format!(
                    "{s:?} in {text:?} is not a CPU number (expected a list like 0-3,8)"
                ))
            })
        };
        let (lo, hi) = (parse(lo)?, parse(hi)?);
        if lo > hi {
            return Err(bad(format!(
                "range {part:?} runs backwards (expected low-high)"
            )));
        }
        if hi >= libc::CPU_SETSIZE as usize {
            return Err(bad(format!(
                "CPU {hi} is beyond the largest supported CPU number {}",
                libc::CPU_SETSIZE - 1
            )));
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Formats CPUs back as a compact list (`0-3,8`).
pub fn format_cpulist(cpus: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

/// The NUMA topology as the kernel shows it under a sysfs root (normally `/sys`).
pub struct Topology {
    node_dir: PathBuf,
}

impl Topology {
    pub fn system() -> Self {
        Self::at(Path::new("/sys"))
    }

    /// A topology read from another root (tests point this at a fake tree).
    pub fn at(sysfs: &Path) -> Self {
        Topology {
            node_dir: sysfs.join("devices/system/node"),
        }
    }

    /// The node ids present, ascending.
    pub fn nodes(&self) -> Result<Vec<u32>> {
        let entries = std::fs::read_dir(&self.node_dir).map_err(|e| {
            DaemonError::Config(format!(
                "{}: cannot list NUMA nodes: {e}",
                self.node_dir.display()
            ))
        })?;
        let mut nodes: Vec<u32> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix("node"))
                    .and_then(|n| n.parse().ok())
            })
            .collect();
        nodes.sort_unstable();
        Ok(nodes)
    }

    /// The CPUs of one node.
    pub fn node_cpus(&self, node: u32) -> Result<Vec<usize>> {
        let path = self.node_dir.join(format!("node{node}/cpulist"));
        let text = std::fs::read_to_string(&path).map_err(|e| {
            DaemonError::Config(format!(
                "{}: cannot read the node's CPUs: {e}",
                path.display()
            ))
        })?;
        parse_cpulist(&text, &path.display().to_string())
    }

    /// Works out what pinning `placement` means on this topology, without applying it.
    pub fn plan(&self, placement: &Placement) -> Result<Plan> {
        match placement {
            Placement::Unpinned => Ok(Plan::Unpinned),
            Placement::Cpus(cpus) => {
                if cpus.is_empty() {
                    return Err(DaemonError::Config(
                        "--cpus: empty CPU list (expected a list like 0-3,8)".into(),
                    ));
                }
                Ok(Plan::Cpus(cpus.clone()))
            }
            Placement::Node(node) => {
                let nodes = self.nodes()?;
                if !nodes.contains(node) {
                    return Err(DaemonError::Config(format!(
                        "--numa-node {node}: no such NUMA node ({} lists nodes {:?})",
                        self.node_dir.display(),
                        nodes
                    )));
                }
                let cpus = self.node_cpus(*node)?;
                if nodes.len() < 2 {
                    return Ok(Plan::SingleNode { node: *node, cpus });
                }
                if cpus.is_empty() {
                    return Err(DaemonError::Config(format!(
                        "--numa-node {node}: the node has no CPUs (a memory-only node); pick a node with CPUs"
                    )));
                }
                Ok(Plan::Node { node: *node, cpus })
            }
        }
    }
}

/// A placement resolved against the topology.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    Unpinned,
    SingleNode { node: u32, cpus: Vec<usize> },
    Node { node: u32, cpus: Vec<usize> },
    Cpus(Vec<usize>),
}

/// Resolves and applies a placement to the calling thread (and so to every thread it starts
/// afterwards). Call it before starting any thread and before opening the model.
pub fn apply(placement: &Placement) -> Result<Applied> {
    match Topology::system().plan(placement)? {
        Plan::Unpinned => Ok(Applied::Unpinned),
        Plan::SingleNode { node, cpus } => Ok(Applied::SingleNode { node, cpus }),
        Plan::Cpus(cpus) => {
            set_affinity(&cpus)?;
            Ok(Applied::Cpus(cpus))
        }
        Plan::Node { node, cpus } => {
            set_affinity(&cpus)?;
            bind_memory(node)?;
            Ok(Applied::Node {
                node,
                cpus,
                memory_bound: true,
            })
        }
    }
}

/// Restricts the calling thread to `cpus`.
pub fn set_affinity(cpus: &[usize]) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET only write inside it, and every cpu was
    // checked to be below CPU_SETSIZE when parsed.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &cpu in cpus {
            if cpu >= libc::CPU_SETSIZE as usize {
                return Err(DaemonError::Config(format!(
                    "CPU {cpu} is beyond the largest supported CPU number {}",
                    libc::CPU_SETSIZE - 1
                )));
            }
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        return Err(DaemonError::Config(format!(
            "cannot pin to cpus {}: {err} (are they online and allowed by this cgroup's cpuset?)",
            format_cpulist(cpus)
        )));
    }
    Ok(())
}

/// Binds the calling thread's future allocations to `node` (`set_mempolicy(MPOL_BIND)`).
pub fn bind_memory(node: u32) -> Result<()> {
    const MPOL_BIND: libc::c_int = 2;
    const BITS: usize = 64;
    let words = (node as usize) / BITS + 1;
    let mut mask = vec![0u64; words];
    mask[node as usize / BITS] |= 1u64 << (node as usize % BITS);
    // maxnode counts bits; the kernel ignores the last one (a long-standing quirk), hence +1.
    let maxnode = (words * BITS + 1) as libc::c_ulong;
    // SAFETY: the mask buffer outlives the call and holds `words` u64s, at least maxnode-1 bits.
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, MPOL_BIND, mask.as_ptr(), maxnode) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        return Err(DaemonError::Config(format!(
            "cannot bind memory to NUMA node {node}: set_mempolicy failed: {err}"
        )));
    }
    Ok(())
}

/// The calling thread's CPU affinity.
pub fn current_affinity() -> Result<Vec<usize>> {
    // SAFETY: sched_getaffinity writes at most size_of::<cpu_set_t>() bytes into `set`.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(DaemonError::Config(format!(
                "sched_getaffinity failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok((0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_kernel_lists() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n", "t").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist("", "t").unwrap(), Vec::<usize>::new());
        assert_eq!(parse_cpulist("5", "t").unwrap(), vec![5]);
    }

    #[test]
    fn rejects_bad_lists_naming_the_value() {
        for bad in ["a", "3-1", "1-", "0,,2", "99999"] {
            let err = parse_cpulist(bad, "--cpus").unwrap_err().to_string();
            assert!(err.starts_with("--cpus: "), "{err}");
        }
    }

    proptest! {
        #[test]
        fn format_then_parse_round_trips(mut cpus in proptest::collection::vec(0usize..256, 0..40)) {
            cpus.sort_unstable();
            cpus.dedup();
            let text = format_cpulist(&cpus);
            prop_assert_eq!(parse_cpulist(&text, "t").unwrap(), cpus);
        }
    }

    fn fake_sysfs(nodes: &[(u32, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (n, list) in nodes {
            let d = dir.path().join(format!("devices/system/node/node{n}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), list).unwrap();
        }
        std::fs::write(dir.path().join("devices/system/node/online"), "0\n").unwrap();
        dir
    }

    #[test]
    fn single_node_machine_runs_unpinned() {
        let sys = fake_sysfs(&[(0, "0-7\n")]);
        let plan = Topology::at(sys.path()).plan(&Placement::Node(0)).unwrap();
        assert_eq!(
            plan,
            Plan::SingleNode {
                node: 0,
                cpus: (0..8).collect()
            }
        );
    }

    #[test]
    fn two_node_machine_pins_to_the_node_cpus() {
        let sys = fake_sysfs(&[(0, "0-3,8-11\n"), (1, "4-7,12-15\n")]);
        let plan = Topology::at(sys.path()).plan(&Placement::Node(1)).unwrap();
        assert_eq!(
            plan,
            Plan::Node {
                node: 1,
                cpus: vec![4, 5, 6, 7, 12, 13, 14, 15]
            }
        );
    }

    #[test]
    fn missing_node_is_an_error_naming_the_nodes() {
        let sys = fake_sysfs(&[(0, "0-3\n"), (1, "4-7\n")]);
        let err = Topology::at(sys.path())
            .plan(&Placement::Node(3))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--numa-node 3") && err.contains("[0, 1]"),
            "{err}"
        );
    }

    #[test]
    fn memory_only_node_is_refused() {
        let sys = fake_sysfs(&[(0, "0-3\n"), (1, "\n")]);
        let err = Topology::at(sys.path())
            .plan(&Placement::Node(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no CPUs"), "{err}");
    }

    #[test]
    fn affinity_to_the_current_set_is_accepted() {
        // Pinning to the CPUs we already have changes nothing and must succeed on any machine.
        let cpus = current_affinity().unwrap();
        assert!(!cpus.is_empty());
        let handle = std::thread::spawn(move || {
            set_affinity(&cpus[..1]).unwrap();
            current_affinity().unwrap()
        });
        assert_eq!(handle.join().unwrap().len(), 1);
    }

    #[test]
    fn memory_binding_to_node0_succeeds() {
        // node0 always exists on Linux; bind a throwaway thread so the test process is unchanged.
        std::thread::spawn(|| bind_memory(0).unwrap())
            .join()
            .unwrap();
    }
}
