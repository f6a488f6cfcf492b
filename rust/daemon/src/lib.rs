//! The DART n-gram daemon: one memory-mapped n-gram model served over gRPC to every worker on
//! a host, with the draft-tree pruner beside it.
//!
//! * [`proto`]: the generated types of `proto/dart/ngram/v1/ngram.proto`.
//! * [`service`]: the handlers (validation, the model and pruner calls, status codes).
//! * [`server`]: binding, serving, health, graceful drain.
//! * [`layer`] and [`metrics`]: per-request metrics and logs, Prometheus exposition.
//! * [`linger`]: closing connections without losing the end of a response.
//! * [`numa`]: pinning threads and memory to a NUMA node.
//! * [`run`]: the whole `dart-ngram serve` process.

pub mod busy_poll;
pub mod error;
pub mod layer;
pub mod linger;
pub mod metrics;
pub mod numa;
pub mod server;
pub mod service;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use dart_ngram::{NGramModel, OpenOptions};

pub use error::{DaemonError, Result};
pub use server::{bind, Bound, ServeOptions, SERVICE_NAME};

/// Generated gRPC types of `proto/dart/ngram/v1/ngram.proto`.
pub mod proto {
    #![allow(clippy::all)]
    tonic::include_proto!("dart.ngram.v1");
}

/// How the daemon logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line (for log shippers).
    #[default]
    Json,
    /// `key=value` text for people.
    Text,
}

/// Everything `dart-ngram serve` needs.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub model: PathBuf,
    pub open: OpenOptions,
    pub placement: numa::Placement,
    /// Threads for the tokio workers and, separately, the rayon pool; `None` = one per CPU
    /// the process may run on.
    pub threads: Option<usize>,
    pub serve: ServeOptions,
    pub log_format: LogFormat,
}

/// Installs the global log subscriber (stderr). The filter comes from `DART_LOG` (or
/// `RUST_LOG`), default `info`. Safe to call twice: the second call does nothing.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = std::env::var("DART_LOG")
        .ok()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.with_ansi(false).try_init(),
    };
}

/// Runs the daemon until SIGTERM/SIGINT, then drains and returns.
///
/// Order matters: pin first (threads inherit the CPU affinity and memory policy of the thread
/// that starts them, and the model's page cache pages are placed by the policy of whoever
/// faults them in), then start the pools, then open the model.
pub fn run(config: DaemonConfig) -> Result<()> {
    init_logging(config.log_format);
    let placement = numa::apply(&config.placement)?;
    tracing::info!(placement = %placement, "placement");

    let threads = match config.threads {
        Some(0) => {
            return Err(DaemonError::Config(
                "--threads 0: expected at least 1 thread".into(),
            ))
        }
        Some(n) => n,
        None => numa::current_affinity()
            .map(|c| c.len())
            .unwrap_or(1)
            .max(1),
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("dart-rayon-{i}"))
        .build_global()
        .map_err(|e| DaemonError::Config(format!("cannot start the rayon pool: {e}")))?;

    let started = Instant::now();
    let model = Arc::new(NGramModel::open_with(&config.model, &config.open)?);
    let info = model.info();
    tracing::info!(
        path = %config.model.display(),
        order = info.order,
        vocab_size = info.vocab_size,
        tokenizer_fingerprint = %info.tokenizer_fingerprint,
        eos_id = ?info.eos_id,
        total_tokens = info.total_tokens,
        total_ngrams = info.total_ngrams,
        bytes = info.bytes,
        populate = config.open.populate,
        prefetch = config.open.prefetch,
        lock = config.open.lock,
        in_memory = config.open.in_memory,
        open_ms = started.elapsed().as_secs_f64() * 1e3,
        "model opened"
    );

    // Busy polling needs the thread that polls to own the sockets: one serving thread then
    // (the rayon pool still spreads large batches over `threads`).
    let busy_poll = config.serve.busy_poll;
    let mut builder = if busy_poll.is_zero() {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads).thread_name("dart-grpc");
        b
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    let runtime = builder
        .enable_all()
        .build()
        .map_err(|source| DaemonError::Io {
            what: "cannot start the tokio runtime for",
            addr: config.serve.listen.to_string(),
            source,
        })?;
    raise_file_limit(config.serve.max_connections);
    runtime.block_on(async move {
        let bound = bind(model, config.serve.clone()).await?;
        // Before "listening": whoever reads that line may signal right away.
        let shutdown = server::termination_signal()?;
        let hangups = server::watch_signal(tokio::signal::unix::SignalKind::hangup(), "SIGHUP")?;
        tokio::spawn(reload_on_hangup(
            hangups,
            bound.server(),
            bound.metrics(),
            config.model.clone(),
            config.open.clone(),
        ));
        let addr = bound.local_addr();
        if !addr.ip().is_loopback() {
            tracing::warn!(
                %addr,
                "listening beyond loopback without TLS: put a TLS proxy in front (docs/daemon.md)"
            );
        }
        let metrics_addr = bound
            .metrics_addr()
            .map_or_else(|| "off".to_string(), |a| a.to_string());
        tracing::info!(
            %addr,
            metrics = %metrics_addr,
            threads,
            serving_threads = if busy_poll.is_zero() { threads } else { 1 },
            busy_poll_us = busy_poll.as_micros() as u64,
            max_request_bytes = config.serve.max_request_bytes,
            max_concurrent = config.serve.limits.max_concurrent,
            max_connections = config.serve.max_connections,
            idle_timeout_secs = config.serve.timeouts.idle.as_secs_f64(),
            limits = ?config.serve.limits.pruner,
            max_top_k_entries = config.serve.limits.max_top_k_entries,
            "listening"
        );
        bound.serve(shutdown).await
    })
}

/// Reopens the model at `path` on every SIGHUP and serves it if it answers for the same
/// tokenizer, vocabulary, order and EOS (see [`service::NGramServer::reload`]); otherwise, or
/// if it cannot be opened, logs why and keeps serving the old one.
async fn reload_on_hangup(
    mut hangups: tokio::signal::unix::Signal,
    server: Arc<service::NGramServer>,
    metrics: Arc<metrics::Metrics>,
    path: PathBuf,
    open: OpenOptions,
) {
    while hangups.recv().await.is_some() {
        tracing::info!(signal = "SIGHUP", path = %path.display(), "reloading the model");
        let started = Instant::now();
        let (p, o) = (path.clone(), open.clone());
        let opened = tokio::task::spawn_blocking(move || NGramModel::open_with(&p, &o)).await;
        let result = match opened {
            Ok(Ok(model)) => {
                let bytes = model.bytes();
                server.reload(Arc::new(model)).map(|()| bytes)
            }
            Ok(Err(err)) => Err(format!("cannot open it: {err}")),
            Err(err) => Err(format!("the loader failed: {err}")),
        };
        match result {
            Ok(bytes) => {
                metrics.reloaded(true);
                metrics.set_model_bytes(bytes);
                tracing::info!(
                    bytes,
                    open_ms = started.elapsed().as_secs_f64() * 1e3,
                    "model reloaded"
                );
            }
            Err(reason) => {
                metrics.reloaded(false);
                tracing::error!(
                    path = %path.display(),
                    reason,
                    "reload refused; still serving the previous model"
                );
            }
        }
    }
}

/// Raises the soft limit on open files to the hard limit: `--max-connections` sockets plus
/// the model and listeners must fit (the usual soft limit is 1024). Warns when they cannot.
fn raise_file_limit(max_connections: usize) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid resource and out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above; raising the soft limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim = raised;
        }
    }
    let needed = max_connections as u64 + 64;
    if lim.rlim_cur < needed {
        tracing::warn!(
            open_files_limit = lim.rlim_cur,
            max_connections,
            "the open-file limit is below --max-connections + 64: raise LimitNOFILE or lower \
             --max-connections"
        );
    }
}
