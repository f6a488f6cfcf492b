//! Closing client connections without losing the end of a response.
//!
//! Closing a TCP socket whose receive buffer still holds unread bytes makes Linux answer with
//! a reset instead of a FIN, and a reset makes the client drop whatever it had not read yet.
//! An HTTP/2 client keeps sending small frames (window updates, ping acknowledgements) while
//! it reads a large response, so a daemon that drains on SIGTERM and closes a connection right
//! after writing the last bytes of a response can destroy that response in the client's
//! buffers. [`Lingering`] closes the way careful HTTP servers do ("lingering close"): once the
//! transport is done with a connection, it shuts the write side (FIN after all the data),
//! reads and discards until the client closes its side or [`LINGER`] passes, and only then
//! closes. [`Closing`] counts those closes so that the daemon waits for them before exiting.
//!
//! A connection also closes (with an error, so the transport drops it) when the client sends
//! nothing within the handshake timeout after connecting, or when no byte moves either way for
//! the idle timeout: idle sockets would otherwise pile up until the file limit refuses real
//! clients. Open connections are counted in [`Metrics`] for the `--max-connections` cap.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::metrics::Metrics;

/// Longest wait for a client to close its side after the daemon closed its own.
pub const LINGER: Duration = Duration::from_secs(2);

/// Lingering closes under way.
#[derive(Default)]
pub struct Closing {
    count: AtomicUsize,
    done: tokio::sync::Notify,
}

impl Closing {
    /// Resolves when no lingering close is under way (immediately if none is).
    pub async fn wait(&self) {
        loop {
            let notified = self.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    fn finish(&self) {
        if self.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_waiters();
        }
    }
}

/// How long a connection may stay silent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// From accept to the client's first byte.
    pub handshake: Duration,
    /// Without a byte read or written, once the client has spoken.
    pub idle: Duration,
}

/// An accepted connection that closes with a linger when dropped (see the module docs).
pub struct Lingering {
    stream: Option<TcpStream>,
    closing: Arc<Closing>,
    metrics: Arc<Metrics>,
    timeouts: Timeouts,
    /// Fires when the connection has been silent too long.
    silence: Pin<Box<Sleep>>,
    spoke: bool,
}

impl Lingering {
    /// Counts the connection open in `metrics` until its close has finished.
    pub fn new(
        stream: TcpStream,
        closing: Arc<Closing>,
        metrics: Arc<Metrics>,
        timeouts: Timeouts,
    ) -> Self {
        metrics.connection_opened(1);
        Lingering {
            stream: Some(stream),
            closing,
            metrics,
            silence: Box::pin(tokio::time::sleep(timeouts.handshake)),
            timeouts,
            spoke: false,
        }
    }

    /// Restarts the silence timer after bytes moved: read (`from_client`) or written. Until
    /// the client has sent something only its bytes count (the server writes its own
    /// preface at once, which must not extend the handshake timeout).
    fn moved(&mut self, from_client: bool) {
        if from_client {
            self.spoke = true;
        } else if !self.spoke {
            return;
        }
        let at = Instant::now() + self.timeouts.idle;
        // Resetting a timer costs a timer-wheel update: skip it while the deadline is fresh.
        if at.saturating_duration_since(self.silence.deadline()) > Duration::from_millis(100) {
            self.silence.as_mut().reset(at);
        }
    }

    /// An error once the silence timer has fired (registers the waker otherwise).
    fn timed_out(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.silence.as_mut().poll(cx).is_pending() {
            return None;
        }
        self.metrics.connection_timed_out();
        let (what, after) = if self.spoke {
            ("idle", self.timeouts.idle)
        } else {
            ("no handshake", self.timeouts.handshake)
        };
        tracing::debug!(
            reason = what,
            secs = after.as_secs_f64(),
            "closing a silent connection"
        );
        Some(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("connection closed: {what} for {after:?}"),
        ))
    }

    fn stream(&mut self) -> &mut TcpStream {
        self.stream
            .as_mut()
            .expect("the stream is only taken when the connection is dropped")
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let Some(mut stream) = self.stream.take() else {
            return;
        };
        let metrics = Arc::clone(&self.metrics);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            metrics.connection_opened(-1);
            return; // no runtime left to linger on: a plain close
        };
        let closing = Arc::clone(&self.closing);
        closing.count.fetch_add(1, Ordering::AcqRel);
        runtime.spawn(async move {
            let _ = tokio::time::timeout(LINGER, async {
                // FIN after everything written so far, then wait for the client's.
                if stream.shutdown().await.is_ok() {
                    let mut sink = [0u8; 4096];
                    while let Ok(n) = stream.read(&mut sink).await {
                        if n == 0 {
                            break;
                        }
                    }
                }
            })
            .await;
            drop(stream);
            metrics.connection_opened(-1);
            closing.finish();
        });
    }
}

impl Connected for Lingering {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream
            .as_ref()
            .expect("the stream is only taken when the connection is dropped")
            .connect_info()
    }
}

impl AsyncRead for Lingering {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(this.stream()).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.moved(true);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match this.timed_out(cx) {
                Some(err) => Poll::Ready(Err(err)),
                None => Poll::Pending,
            },
            other => other,
        }
    }
}

impl AsyncWrite for Lingering {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(this.stream()).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.moved(false);
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(this.stream()).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.moved(false);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream
            .as_ref()
            .is_some_and(tokio::io::AsyncWrite::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.get_mut().stream()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.get_mut().stream()).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// The server writes a response and drops the connection while the client's bytes sit
    /// unread in its receive buffer: with a plain close the client would see a reset; with a
    /// lingering close it reads the whole response, then EOF.
    #[tokio::test]
    async fn a_response_survives_unread_client_bytes_at_close() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let closing = Arc::new(Closing::default());
        let mut client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let metrics = Arc::new(Metrics::new());
        let timeouts = Timeouts {
            handshake: Duration::from_secs(60),
            idle: Duration::from_secs(60),
        };
        let mut server = Lingering::new(
            accepted,
            Arc::clone(&closing),
            Arc::clone(&metrics),
            timeouts,
        );
        assert_eq!(metrics.connections_open(), 1);
        client.write_all(&[7u8; 1000]).await.unwrap();
        // Let the client's bytes arrive before the server closes.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let response = vec![42u8; 1 << 20];
        server.write_all(&response).await.unwrap();
        drop(server);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), response.len());
        drop(client);
        tokio::time::timeout(Duration::from_secs(5), closing.wait())
            .await
            .expect("the lingering close ends once the client has closed");
        assert_eq!(closing.count.load(Ordering::Acquire), 0);
        assert_eq!(metrics.connections_open(), 0);
    }

    /// A client that connects and sends nothing is closed after the handshake timeout; one
    /// that spoke and then went silent, after the idle timeout. Paused time: no waiting.
    #[tokio::test(start_paused = true)]
    async fn silent_connections_are_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let closing = Arc::new(Closing::default());
        let metrics = Arc::new(Metrics::new());
        let timeouts = Timeouts {
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(300),
        };
        let _silent = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let mut server = Lingering::new(
            accepted,
            Arc::clone(&closing),
            Arc::clone(&metrics),
            timeouts,
        );
        let started = Instant::now();
        let mut buf = [0u8; 16];
        let err = server.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("no handshake"), "{err}");
        assert_eq!(started.elapsed().as_secs(), 10);

        let mut talker = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let mut server = Lingering::new(
            accepted,
            Arc::clone(&closing),
            Arc::clone(&metrics),
            timeouts,
        );
        talker.write_all(b"hello").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 5);
        let started = Instant::now();
        let err = server.read(&mut buf).await.unwrap_err();
        assert!(err.to_string().contains("idle"), "{err}");
        assert_eq!(started.elapsed().as_secs(), 300);
        assert_eq!(metrics.connections_timed_out(), 2);
    }
}
