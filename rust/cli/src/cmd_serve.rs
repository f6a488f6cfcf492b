//! `dart-ngram serve`: the shared n-gram daemon (gRPC), see `docs/daemon.md`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use dart_daemon::linger::Timeouts;
use dart_daemon::numa::{parse_cpulist, Placement};
use dart_daemon::service::ServiceLimits;
use dart_daemon::{DaemonConfig, LogFormat, ServeOptions};
use dart_ngram::OpenOptions;
use dart_pruner::PrunerLimits;

/// Seconds from a flag: finite, > 0.
fn seconds(flag: &str, value: f64) -> Result<Duration, String> {
    if value.is_finite() && value > 0.0 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(format!(
            "--{flag} {value}: expected a number of seconds > 0"
        ))
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// The n-gram model to serve (one read-only mapping shared by every connection).
    #[arg(long, value_name = "MODEL.ngram")]
    model: PathBuf,
    /// Address to listen on. Loopback by default: the daemon speaks plaintext gRPC, so put a
    /// TLS proxy in front of it before exposing it (docs/daemon.md).
    #[arg(long, default_value = "127.0.0.1:50051", value_name = "ADDR:PORT")]
    listen: SocketAddr,
    /// Pin every thread to this NUMA node's CPUs and bind its memory to the node.
    #[arg(long, value_name = "N", conflicts_with = "cpus")]
    numa_node: Option<u32>,
    /// Pin every thread to these CPUs (a list like 0-7,16-23).
    #[arg(long, value_name = "LIST")]
    cpus: Option<String>,
    /// gRPC worker threads, and separately the size of the pool that runs batches
    /// [default: the CPUs the process may use].
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Largest request accepted, in bytes; larger ones get RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 16 << 20, value_name = "BYTES")]
    max_request_bytes: usize,
    /// Requests handled at once; more get RESOURCE_EXHAUSTED right away.
    #[arg(long, default_value_t = 256, value_name = "N")]
    max_concurrent: usize,
    /// Serve Prometheus metrics over HTTP on this address (GET /metrics).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics_listen: Option<SocketAddr>,
    /// Read the whole model into the page cache at start (MAP_POPULATE).
    #[arg(long)]
    populate: bool,
    /// Read the model into the page cache in the background and serve at once (the
    /// non-blocking --populate: requests wait on the disk only until its pages are read).
    #[arg(long, conflicts_with_all = ["populate", "in_memory"])]
    prefetch: bool,
    /// Lock the model's pages in RAM (mlock; needs LimitMEMLOCK / CAP_IPC_LOCK).
    #[arg(long)]
    lock: bool,
    /// Advise transparent huge pages for the mapping.
    #[arg(long)]
    huge_pages: bool,
    /// Copy the model into anonymous memory on huge pages instead of mapping the file (RAM
    /// for the whole model, per daemon; faster lookups when caches are cold).
    #[arg(long, conflicts_with_all = ["populate", "huge_pages"])]
    in_memory: bool,
    /// Advise random access for the mapping (MADV_RANDOM: a page fault reads one page, not
    /// the kernel's read-around window): for models larger than RAM or served cold.
    #[arg(long, conflicts_with = "in_memory")]
    random_access: bool,
    /// Check every invariant too before serving (a full scan; every section's checksum is
    /// checked at open anyway unless --skip-checksums).
    #[arg(long)]
    verify: bool,
    /// Check only the header, the section table and the small sections at open, not every
    /// section's checksum (for models too large to read once at start).
    #[arg(long, conflicts_with = "verify")]
    skip_checksums: bool,
    /// After each request, keep polling the sockets this many microseconds before sleeping:
    /// saves the wake-up of an idle CPU (tens of microseconds on many VMs) on every request of
    /// a decode loop, at the price of a busy core while requests keep coming. Serves on one
    /// thread (--threads then sizes only the pool for batched requests). 0 = off.
    #[arg(long, default_value_t = 0, value_name = "MICROS")]
    busy_poll_us: u64,
    /// Draft levels one prune may carry (more: RESOURCE_EXHAUSTED).
    #[arg(long, default_value_t = PrunerLimits::default().max_levels, value_name = "N")]
    max_levels: usize,
    /// Candidates per level (k) one prune may carry.
    #[arg(long, default_value_t = PrunerLimits::default().max_k, value_name = "N")]
    max_k: usize,
    /// Largest beam_width a request's configuration may ask for.
    #[arg(long, default_value_t = PrunerLimits::default().max_beam_width, value_name = "N")]
    max_beam_width: usize,
    /// Largest tree (max_nodes or budget) a request may ask for.
    #[arg(long, default_value_t = PrunerLimits::default().max_nodes, value_name = "N")]
    max_nodes: usize,
    /// Paths one prune may score (levels x k x beam width, about; ~60 bytes each).
    #[arg(long, default_value_t = PrunerLimits::default().max_scored_paths, value_name = "N")]
    max_scored_paths: usize,
    /// Entries (rows x k) one TopK request may ask for.
    #[arg(long, default_value_t = ServiceLimits::default().max_top_k_entries, value_name = "N")]
    max_top_k_entries: usize,
    /// Connections open at once; more are closed as soon as they are accepted.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    max_connections: usize,
    /// Seconds a new connection may take to send its first bytes.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    handshake_timeout: f64,
    /// Seconds a connection may stay silent (no byte either way) before it is closed; clients
    /// reconnect on their next call.
    #[arg(long, default_value_t = 300.0, value_name = "SECS")]
    idle_timeout: f64,
    /// Seconds a shutdown waits for requests in flight.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    shutdown_grace: f64,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormatArg::Json)]
    log_format: LogFormatArg,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormatArg {
    Json,
    Text,
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let placement = match (args.numa_node, &args.cpus) {
        (Some(node), _) => Placement::Node(node),
        (None, Some(list)) => {
            let cpus = parse_cpulist(list, "--cpus")?;
            if cpus.is_empty() {
                return Err("--cpus: empty CPU list (expected a list like 0-3,8)".into());
            }
            Placement::Cpus(cpus)
        }
        (None, None) => Placement::Unpinned,
    };
    if !(args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0) {
        return Err(format!(
            "--shutdown-grace {}: expected a number of seconds >= 0",
            args.shutdown_grace
        )
        .into());
    }
    if args.max_request_bytes < 1024 {
        return Err(format!(
            "--max-request-bytes {}: expected at least 1024 (a single prune request is ~2 KB)",
            args.max_request_bytes
        )
        .into());
    }
    for (flag, value) in [
        ("max-levels", args.max_levels),
        ("max-k", args.max_k),
        ("max-beam-width", args.max_beam_width),
        ("max-nodes", args.max_nodes),
        ("max-scored-paths", args.max_scored_paths),
        ("max-concurrent", args.max_concurrent),
        ("max-top-k-entries", args.max_top_k_entries),
        ("max-connections", args.max_connections),
    ] {
        if value == 0 {
            return Err(format!("--{flag} 0: expected at least 1").into());
        }
    }
    let pruner_limits = PrunerLimits {
        max_levels: args.max_levels,
        max_k: args.max_k,
        max_beam_width: args.max_beam_width,
        max_nodes: args.max_nodes,
        max_scored_paths: args.max_scored_paths,
    };
    pruner_limits.validate().map_err(|e| {
        e.to_string()
            .replace("limit max_", "--max-")
            .replace('_', "-")
    })?;
    let timeouts = Timeouts {
        handshake: seconds("handshake-timeout", args.handshake_timeout)?,
        idle: seconds("idle-timeout", args.idle_timeout)?,
    };
    let config = DaemonConfig {
        model: args.model,
        open: OpenOptions {
            verify: args.verify,
            populate: args.populate,
            prefetch: args.prefetch,
            lock: args.lock,
            huge_pages: args.huge_pages,
            in_memory: args.in_memory,
            skip_checksums: args.skip_checksums,
            random_access: args.random_access,
        },
        placement,
        threads: args.threads,
        serve: ServeOptions {
            listen: args.listen,
            max_request_bytes: args.max_request_bytes,
            limits: ServiceLimits {
                max_concurrent: args.max_concurrent,
                pruner: pruner_limits,
                max_top_k_entries: args.max_top_k_entries,
            },
            max_connections: args.max_connections,
            timeouts,
            metrics_listen: args.metrics_listen,
            shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
            busy_poll: Duration::from_micros(args.busy_poll_us),
            ..ServeOptions::default()
        },
        log_format: match args.log_format {
            LogFormatArg::Json => LogFormat::Json,
            LogFormatArg::Text => LogFormat::Text,
        },
    };
    dart_daemon::run(config)?;
    Ok(())
}
