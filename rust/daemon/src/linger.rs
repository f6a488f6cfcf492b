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

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

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

/// An accepted connection that closes with a linger when dropped (see the module docs).
pub struct Lingering {
    stream: Option<TcpStream>,
    closing: Arc<Closing>,
}

impl Lingering {
    pub fn new(stream: TcpStream, closing: Arc<Closing>) -> Self {
        Lingering {
            stream: Some(stream),
            closing,
        }
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
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
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
        Pin::new(self.get_mut().stream()).poll_read(cx, buf)
    }
}

impl AsyncWrite for Lingering {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.get_mut().stream()).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.get_mut().stream()).poll_write_vectored(cx, bufs)
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
        let mut server = Lingering::new(accepted, Arc::clone(&closing));
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
    }
}
