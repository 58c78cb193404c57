//! Guest stdout and stderr: captured per attempt, bounded, never failing.
//!
//! A guest that prints more than the cap keeps running: the excess is
//! counted and dropped, not refused (a refused write makes Rust's `print!`
//! panic, which would turn a chatty plugin into a failing one).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};

#[derive(Default)]
struct Buffer {
    kept: Vec<u8>,
    dropped: usize,
}

/// One captured stream; clones share the buffer.
#[derive(Clone)]
pub struct Capture {
    cap: usize,
    buffer: Arc<Mutex<Buffer>>,
}

impl Capture {
    pub fn new(cap: usize) -> Capture {
        Capture {
            cap,
            buffer: Arc::default(),
        }
    }

    /// What was kept, and how many bytes were dropped past the cap.
    pub fn contents(&self) -> (Vec<u8>, usize) {
        self.buffer
            .lock()
            .map(|b| (b.kept.clone(), b.dropped))
            .unwrap_or_default()
    }
}

impl IsTerminal for Capture {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Capture {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl AsyncWrite for Capture {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if let Ok(mut b) = self.buffer.lock() {
            let room = self.cap.saturating_sub(b.kept.len());
            let keep = room.min(buf.len());
            b.kept.extend_from_slice(&buf[..keep]);
            b.dropped += buf.len() - keep;
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    #[tokio::test]
    async fn keeps_up_to_the_cap_and_counts_the_rest() {
        let c = Capture::new(4);
        let mut w = c.clone();
        w.write_all(b"abc").await.unwrap();
        w.write_all(b"defg").await.unwrap();
        assert_eq!(c.contents(), (b"abcd".to_vec(), 3));
    }
}
