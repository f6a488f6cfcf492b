//! Binding, serving and draining: the daemon's life cycle.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dart_ngram::NGramModel;
use dart_pruner::PrunerConfig;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Server;
use tonic_health::ServingStatus;

/// How long a drained daemon (no request in flight) waits for its clients to acknowledge the
/// shutdown and close their connections before it stops anyway. A client that does not answer
/// (wedged, stopped) must not hold the daemon for the whole shutdown grace period.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

use crate::error::{DaemonError, Result};
use crate::layer::ObserveLayer;
use crate::metrics::Metrics;
use crate::proto::n_gram_service_server::NGramServiceServer;
use crate::service::NGramServer;

/// The fully qualified service name, as health checks name it.
pub const SERVICE_NAME: &str = "dart.ngram.v1.NGramService";

/// Everything about serving that is not the model itself.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// Largest request message accepted, in bytes (larger: RESOURCE_EXHAUSTED).
    pub max_request_bytes: usize,
    /// Requests handled at once (more: RESOURCE_EXHAUSTED).
    pub max_concurrent: usize,
    pub metrics_listen: Option<SocketAddr>,
    /// How long a shutdown waits for requests in flight before giving up on them.
    pub shutdown_grace: Duration,
    /// The pruner configuration requests without overrides get.
    pub pruner: PrunerConfig,
    /// After each request, keep polling the sockets this long before sleeping (zero: off);
    /// see [`crate::busy_poll`].
    pub busy_poll: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            max_request_bytes: 16 << 20,
            max_concurrent: 256,
            metrics_listen: None,
            shutdown_grace: Duration::from_secs(30),
            pruner: PrunerConfig::default(),
            busy_poll: Duration::ZERO,
        }
    }
}

/// A daemon whose sockets are bound (so their addresses are known, even for port 0) but which
/// does not serve yet.
pub struct Bound {
    grpc: TcpListener,
    metrics_listener: Option<TcpListener>,
    server: Arc<NGramServer>,
    metrics: Arc<Metrics>,
    options: ServeOptions,
}

/// Binds the gRPC (and metrics) sockets for `model`.
pub async fn bind(model: Arc<NGramModel>, options: ServeOptions) -> Result<Bound> {
    let server = Arc::new(NGramServer::new(
        Arc::clone(&model),
        options.pruner.clone(),
        options.max_concurrent,
    )?);
    let grpc = TcpListener::bind(options.listen)
        .await
        .map_err(|source| DaemonError::Io {
            what: "cannot listen on",
            addr: options.listen.to_string(),
            source,
        })?;
    let metrics_listener = match options.metrics_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| DaemonError::Io {
                    what: "cannot listen for metrics on",
                    addr: addr.to_string(),
                    source,
                })?,
        ),
        None => None,
    };
    let metrics = Arc::new(Metrics::new());
    metrics.set_model_bytes(model.bytes());
    Ok(Bound {
        grpc,
        metrics_listener,
        server,
        metrics,
        options,
    })
}

impl Bound {
    pub fn local_addr(&self) -> SocketAddr {
        self.grpc
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// Serves until `shutdown` resolves, then stops accepting, marks itself NOT_SERVING,
    /// lets requests in flight finish (at most `shutdown_grace`) and returns.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let Bound {
            grpc,
            metrics_listener,
            server,
            metrics,
            options,
        } = self;
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_serving::<NGramServiceServer<Arc<NGramServer>>>()
            .await;
        let service = NGramServiceServer::new(server)
            .max_decoding_message_size(options.max_request_bytes)
            // Responses are bounded by what the request asked for; do not cap them below.
            .max_encoding_message_size(usize::MAX);

        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let metrics_task = metrics_listener.map(|listener| {
            let mut rx = stop_rx.clone();
            tokio::spawn(crate::metrics::serve_http(
                listener,
                Arc::clone(&metrics),
                async move {
                    let _ = rx.wait_for(|&s| s).await;
                },
            ))
        });

        let grace = options.shutdown_grace;
        let drain_started = Arc::new(tokio::sync::Notify::new());
        let drain_started2 = Arc::clone(&drain_started);
        let draining_metrics = Arc::clone(&metrics);
        let signal = async move {
            shutdown.await;
            tracing::info!(
                "shutdown requested: refusing new connections, draining requests in flight"
            );
            reporter
                .set_service_status("", ServingStatus::NotServing)
                .await;
            reporter
                .set_not_serving::<NGramServiceServer<Arc<NGramServer>>>()
                .await;
            // Let the requests already received finish before the transport starts closing
            // connections: a request whose body is still arriving when the HTTP/2 shutdown
            // begins can otherwise be reset under load. A request stays in flight until its
            // response body has been handed over (see `layer`).
            let deadline = tokio::time::Instant::now() + grace;
            while draining_metrics.in_flight() > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            drain_started2.notify_one();
        };

        let activity = (!options.busy_poll.is_zero()).then(|| {
            let activity = crate::busy_poll::Activity::new();
            tokio::spawn(crate::busy_poll::poll_while_busy(
                Arc::clone(&activity),
                options.busy_poll,
            ));
            activity
        });
        let closing = Arc::new(crate::linger::Closing::default());
        let serve = Server::builder()
            .layer(ObserveLayer::new(
                Arc::clone(&metrics),
                options.max_request_bytes,
                activity,
            ))
            .add_service(health)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming(grpc, Arc::clone(&closing)), signal);

        let result = tokio::select! {
            r = serve => r.map_err(DaemonError::from),
            busy = drained_and_idle(&drain_started, &metrics, grace) => {
                if busy {
                    tracing::warn!(
                        grace_secs = grace.as_secs_f64(),
                        "requests still in flight after the shutdown grace period; exiting anyway"
                    );
                } else {
                    tracing::info!(
                        close_wait_secs = CLOSE_WAIT.as_secs_f64(),
                        "clients did not close their idle connections; closing them"
                    );
                }
                Ok(())
            }
        };
        // Connections the transport has let go of finish closing (at most LINGER more).
        let _ = tokio::time::timeout(crate::linger::LINGER, closing.wait()).await;
        let _ = stop_tx.send(true);
        if let Some(task) = metrics_task {
            let _ = task.await;
        }
        tracing::info!("stopped");
        result
    }
}

/// Once the drain has started, resolves when no request has been in flight for `CLOSE_WAIT`
/// (`false`: connections that are still open are idle) or when `grace` has passed (`true`:
/// requests are still in flight). Until then the transport closes connections as clients
/// acknowledge the shutdown.
async fn drained_and_idle(
    drain_started: &tokio::sync::Notify,
    metrics: &Metrics,
    grace: Duration,
) -> bool {
    drain_started.notified().await;
    let start = tokio::time::Instant::now();
    let mut idle_since = start;
    loop {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = tokio::time::Instant::now();
        if metrics.in_flight() > 0 {
            idle_since = now;
        } else if now - idle_since >= CLOSE_WAIT {
            return false;
        }
        if now - start >= grace {
            return true;
        }
    }
}

/// Accepted connections with Nagle's algorithm off, closed with a linger (see `linger`).
/// `Server::tcp_nodelay` only applies to listeners tonic binds itself; without this a response
/// written in two pieces waits for the client's delayed ACK (~40 ms per call on Linux
/// loopback).
fn incoming(
    listener: TcpListener,
    closing: Arc<crate::linger::Closing>,
) -> impl tokio_stream::Stream<Item = std::io::Result<crate::linger::Lingering>> {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(listener).map(move |accepted| {
        let stream = accepted?;
        if let Err(err) = stream.set_nodelay(true) {
            tracing::warn!(error = %err, "cannot set TCP_NODELAY on a connection");
        }
        Ok(crate::linger::Lingering::new(stream, Arc::clone(&closing)))
    })
}

/// Watches SIGTERM and SIGINT from now on (so a signal that arrives before the returned future
/// is first polled is not lost, nor fatal) and resolves on the first of them. Call it inside
/// the runtime, before announcing that the daemon listens.
pub fn termination_signal() -> Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{signal, SignalKind};
    let watch = |kind: SignalKind, name: &str| {
        signal(kind).map_err(|source| DaemonError::Io {
            what: "cannot watch",
            addr: name.to_string(),
            source,
        })
    };
    let mut term = watch(SignalKind::terminate(), "SIGTERM")?;
    let mut int = watch(SignalKind::interrupt(), "SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!(signal = "SIGTERM", "signal received"),
            _ = int.recv() => tracing::info!(signal = "SIGINT", "signal received"),
        }
    })
}
