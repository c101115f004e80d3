//! The usage writer: one thread owning a connection, committing queued usage rows in groups.
//! `record` resolves once the row is durably committed, so a handler that awaits it before
//! completing the response never acknowledges a request whose row could still be lost.

use std::path::Path;
use std::sync::mpsc;

use anyhow::Result;
use tokio::sync::oneshot;

use super::db::{self, UsageRow};

struct Msg {
    row: UsageRow,
    ack: Option<oneshot::Sender<Result<(), String>>>,
}

#[derive(Clone)]
pub struct UsageWriter {
    tx: mpsc::Sender<Msg>,
}

/// Rows committed in one transaction at most.
const GROUP: usize = 512;

impl UsageWriter {
    pub fn start(path: &Path) -> Result<Self> {
        let conn = db::open(path)?;
        let (tx, rx) = mpsc::channel::<Msg>();
        std::thread::Builder::new().name("usage-writer".into()).spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                while batch.len() < GROUP {
                    match rx.try_recv() {
                        Ok(m) => batch.push(m),
                        Err(_) => break,
                    }
                }
                let rows: Vec<UsageRow> = batch.iter().map(|m| m.row.clone()).collect();
                let res = db::insert_usage(&conn, &rows).map_err(|e| format!("{e:#}"));
                if let Err(e) = &res {
                    tracing::error!(error = %e, rows = rows.len(), "writing usage rows failed");
                }
                for m in batch {
                    if let Some(ack) = m.ack {
                        let _ = ack.send(res.clone());
                    }
                }
            }
        })?;
        Ok(Self { tx })
    }

    /// Queues the row and waits until it is committed.
    pub async fn record(&self, row: UsageRow) -> Result<(), String> {
        let (ack, done) = oneshot::channel();
        self.tx.send(Msg { row, ack: Some(ack) }).map_err(|_| "the usage writer stopped".to_string())?;
        done.await.map_err(|_| "the usage writer stopped".to_string())?
    }

    /// Queues the row without waiting (aborted requests: nobody is waiting for a response).
    pub fn record_nowait(&self, row: UsageRow) {
        let _ = self.tx.send(Msg { row, ack: None });
    }
}
