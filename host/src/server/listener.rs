//! The HTTP listener: connections accepted under a cap on all of them and on each client address,
//! each served by hyper (HTTP/1.1 and HTTP/2) with a header-read timeout. hyper arms that timeout
//! whenever a connection waits for a request's head, so it closes slowloris clients (headers
//! dripped byte by byte), connections that never send anything, and idle keep-alive connections
//! alike. (Bodies have their own timeout, in `extract.rs`.) A connection over a cap is closed at
//! once, before any byte is read: every one held open costs a task and socket buffers.
//!
//! Written out rather than `axum::serve` because that fixes hyper's builder (no timer, so no
//! header timeout) and has no connection limits.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// `--max-connections`, `--max-connections-per-client`, `--header-read-timeout`.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    pub max_total: usize,
    pub max_per_client: usize,
    pub header_read_timeout: Duration,
}

/// Open connections, in all and per client address.
#[derive(Default)]
struct Open {
    total: usize,
    per_client: HashMap<IpAddr, usize>,
}

/// One accepted connection's place in the count; given back when the connection ends.
struct Slot {
    open: Arc<Mutex<Open>>,
    client: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = self.open.lock().unwrap_or_else(|p| p.into_inner());
        o.total -= 1;
        if let Some(n) = o.per_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                o.per_client.remove(&self.client);
            }
        }
    }
}

/// A slot for a connection from `client`, or None when a cap is reached.
fn take_slot(open: &Arc<Mutex<Open>>, limits: &ConnectionLimits, client: IpAddr) -> Option<Slot> {
    let mut o = open.lock().unwrap_or_else(|p| p.into_inner());
    let mine = o.per_client.get(&client).copied().unwrap_or(0);
    if o.total >= limits.max_total || mine >= limits.max_per_client {
        return None;
    }
    o.total += 1;
    *o.per_client.entry(client).or_insert(0) += 1;
    Some(Slot { open: open.clone(), client })
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting and waits for the
/// open connections to finish their requests (as `axum::serve`'s graceful shutdown does).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    refused: impl Fn() + Send + Sync + 'static,
    shutdown: impl Future<Output = ()>,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let open = Arc::new(Mutex::new(Open::default()));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Some(slot) = take_slot(&open, &limits, peer.ip()) else {
            refused();
            tracing::debug!(client = %peer.ip(), "connection refused: too many open connections");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (builder, watcher, app) = (builder.clone(), graceful.watcher(), app.clone());
        let timeout = limits.header_read_timeout;
        tokio::spawn(async move {
            // Until its first byte hyper sniffs the protocol (HTTP/1, or an HTTP/2 preface)
            // outside its header timer: a connection silent for the header timeout is closed.
            let mut first = [0u8; 1];
            if !matches!(tokio::time::timeout(timeout, stream.peek(&mut first)).await, Ok(Ok(1..))) {
                drop(slot);
                return;
            }
            let service = TowerToHyperService::new(app);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_in_all_and_per_client_and_given_back() {
        let limits = ConnectionLimits { max_total: 3, max_per_client: 2, header_read_timeout: Duration::from_secs(1) };
        let open = Arc::new(Mutex::new(Open::default()));
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
        let a1 = take_slot(&open, &limits, a).unwrap();
        let _a2 = take_slot(&open, &limits, a).unwrap();
        assert!(take_slot(&open, &limits, a).is_none(), "per-client cap");
        let _b1 = take_slot(&open, &limits, b).unwrap();
        assert!(take_slot(&open, &limits, b).is_none(), "total cap");
        drop(a1);
        assert!(take_slot(&open, &limits, b).is_some(), "a closed connection gives its slot back");
        assert_eq!(open.lock().unwrap().per_client.get(&a), Some(&1));
    }
}
