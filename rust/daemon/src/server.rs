//! Binding, serving and draining: the daemon's life cycle.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, Ordering};

use dart_ngram::NGramModel;
use dart_pruner::PrunerConfig;
use tokio::net::TcpListener;
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
use crate::service::{NGramServer, ServiceLimits};

/// The fully qualified service name, as health checks name it.
pub const SERVICE_NAME: &str = "dart.ngram.v1.NGramService";

/// Everything about serving that is not the model itself.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// Largest request message accepted, in bytes (larger: RESOURCE_EXHAUSTED).
    pub max_request_bytes: usize,
    /// Requests handled at once (more: RESOURCE_EXHAUSTED), and what one request may ask.
    pub limits: ServiceLimits,
    /// Connections open at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// How long a connection may stay silent (see [`crate::linger::Timeouts`]).
    pub timeouts: crate::linger::Timeouts,
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
            limits: ServiceLimits::default(),
            max_connections: 1000,
            timeouts: crate::linger::Timeouts {
                handshake: Duration::from_secs(10),
                idle: Duration::from_secs(300),
            },
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
    if options.max_connections == 0 {
        return Err(DaemonError::Config(
            "--max-connections 0: expected at least 1".into(),
        ));
    }
    let metrics = Arc::new(Metrics::new());
    metrics.set_model_bytes(model.bytes());
    let server = Arc::new(NGramServer::new(
        Arc::clone(&model),
        options.pruner.clone(),
        options.limits,
        Arc::clone(&metrics),
    )?);
    // Weak: the server holds the metrics, which must not keep the server alive.
    let weak = Arc::downgrade(&server);
    metrics.set_resident_probe(Box::new(move || {
        weak.upgrade()?.model().resident_bytes().ok()
    }));
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

    /// The service state (to reload its model).
    pub fn server(&self) -> Arc<NGramServer> {
        Arc::clone(&self.server)
    }

    /// Serves until `shutdown` resolves, then closes its listening socket (new connections
    /// are refused), marks itself NOT_SERVING, answers new requests on open connections
    /// UNAVAILABLE (clients retry elsewhere or later), lets the requests already received
    /// finish (at most `shutdown_grace`) and returns.
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
        let draining = Arc::new(AtomicBool::new(false));
        let draining2 = Arc::clone(&draining);
        let (stop_accepting, accepting) = tokio::sync::watch::channel(false);
        let signal = async move {
            shutdown.await;
            draining2.store(true, Ordering::SeqCst);
            let _ = stop_accepting.send(true);
            tracing::info!(
                in_flight = draining_metrics.in_flight(),
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
                draining,
            ))
            .add_service(health)
            .add_service(service)
            .serve_with_incoming_shutdown(
                incoming(
                    grpc,
                    Arc::clone(&closing),
                    Arc::clone(&metrics),
                    &options,
                    accepting,
                ),
                signal,
            );

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

/// Accepted connections with Nagle's algorithm off, closed with a linger and after a silence
/// (see `linger`), at most `max_connections` open at once. `Server::tcp_nodelay` only applies
/// to listeners tonic binds itself; without it a response written in two pieces waits for the
/// client's delayed ACK (~40 ms per call on Linux loopback).
///
/// When `stop` turns true the listening socket is closed at once (new connections are
/// refused by the kernel) while the stream stays open: the transport keeps serving the
/// connections it has until the drain ends.
fn incoming(
    listener: TcpListener,
    closing: Arc<crate::linger::Closing>,
    metrics: Arc<Metrics>,
    options: &ServeOptions,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> impl tokio_stream::Stream<Item = std::io::Result<crate::linger::Lingering>> {
    use tokio_stream::StreamExt;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let max_connections = options.max_connections;
    let timeouts = options.timeouts;
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = stop.wait_for(|&s| s) => break,
                accepted = listener.accept() => accepted,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors and the like: wait for closes instead of spinning.
                    tracing::warn!(error = %err, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if metrics.connections_open() >= max_connections as i64 {
                let refused = metrics.connection_refused();
                if refused.is_power_of_two() {
                    tracing::warn!(
                        max_connections,
                        refused,
                        "connection refused: --max-connections connections are open"
                    );
                }
                drop(stream);
                continue;
            }
            if let Err(err) = stream.set_nodelay(true) {
                tracing::warn!(error = %err, "cannot set TCP_NODELAY on a connection");
            }
            let conn = crate::linger::Lingering::new(
                stream,
                Arc::clone(&closing),
                Arc::clone(&metrics),
                timeouts,
            );
            if tx.send(Ok(conn)).await.is_err() {
                break;
            }
        }
        // The listening socket closes here. The stream handed to the transport does not end
        // with it (`pending` follows): its end would make the transport close every
        // connection at once instead of after the drain.
        drop(listener);
    });
    tokio_stream::wrappers::ReceiverStream::new(rx).chain(tokio_stream::pending())
}

/// Watches SIGTERM and SIGINT from now on (so a signal that arrives before the returned future
/// is first polled is not lost, nor fatal) and resolves on the first of them. Call it inside
/// the runtime, before announcing that the daemon listens.
pub fn termination_signal() -> Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::SignalKind;
    let mut term = watch_signal(SignalKind::terminate(), "SIGTERM")?;
    let mut int = watch_signal(SignalKind::interrupt(), "SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!(signal = "SIGTERM", "signal received"),
            _ = int.recv() => tracing::info!(signal = "SIGINT", "signal received"),
        }
    })
}

/// Watches a signal from now on (its default action, often exiting, no longer applies).
pub fn watch_signal(
    kind: tokio::signal::unix::SignalKind,
    name: &str,
) -> Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(kind).map_err(|source| DaemonError::Io {
        what: "cannot watch",
        addr: name.to_string(),
        source,
    })
}
