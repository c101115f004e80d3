//! Multi-tenancy: tenants and API keys in SQLite, per tenant/key limits, usage accounting.
//!
//! - [`db`]: schema, migrations and queries (the CLI uses them on the file directly).
//! - [`keys`]: key format and HMAC-SHA256 hashing.
//! - [`limits`]: the atomic rate limiter with token reservations.
//! - [`usage`]: the durable usage writer.
//!
//! Nothing here knows HTTP: the server side (key check, admission, usage and admin endpoints) is
//! `server::tenancy` and `server::admin::tenants`.
//! - [`cli`]: `wasmserve tenants ...` and `wasmserve keys ...`.

pub mod cli;
pub mod db;
pub mod keys;
pub mod limits;
pub mod usage;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use rusqlite::Connection;

use db::Principal;
use limits::Limiter;
use usage::UsageWriter;

/// The server's tenancy state (present when `serve --db` is given).
pub struct Tenancy {
    pub path: PathBuf,
    secret: Vec<u8>,
    /// Lookups and admin writes (in `spawn_blocking`); usage rows go through `usage`.
    conn: Mutex<Connection>,
    /// Usage reports (`GET /v1/usage`, `/admin/usage`) on a connection of their own: a report
    /// over many rows can take a while, and on `conn` it would hold up every tenant's key check.
    /// WAL lets it read while `conn` and the usage writer go on.
    reports: Mutex<Connection>,
    /// MAC of the admin key, so comparing does not depend on where a guess differs or its length.
    admin_mac: Option<Vec<u8>>,
    pub limiter: Arc<Limiter>,
    pub usage: UsageWriter,
}

/// An authenticated request's tenant and key, plus what the budget check needs.
#[derive(Clone, Debug)]
pub struct Caller {
    pub principal: Principal,
    /// Tokens used in the current budget window per the usage table (tenant, key).
    pub budget_used: (u64, u64),
}

impl Tenancy {
    pub fn open(path: &Path, admin_key: Option<&str>, key_secret: Option<&str>) -> Result<Arc<Self>> {
        let conn = db::open(path)?;
        let secret = db::key_secret(&conn, key_secret).context("reading the key secret")?;
        let admin_mac = admin_key.filter(|k| !k.is_empty()).map(|k| keys::hash(&secret, k));
        let reports = db::open(path)?;
        let usage = UsageWriter::start(path)?;
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            secret,
            conn: Mutex::new(conn),
            reports: Mutex::new(reports),
            admin_mac,
            limiter: Limiter::new(),
            usage,
        }))
    }

    pub fn has_admin(&self) -> bool {
        self.admin_mac.is_some()
    }

    pub fn is_admin(&self, key: &str) -> bool {
        self.admin_mac.as_ref().is_some_and(|m| keys::verify(&self.secret, key, m))
    }

    /// Runs `f` on the lookup connection off the async runtime.
    pub async fn with_conn<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Connection, &[u8]) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let conn = me.conn.lock().unwrap_or_else(|e| e.into_inner());
            f(&conn, &me.secret)
        })
        .await
        .context("database task panicked")?
    }

    /// Runs the read-only report `f` on the reports connection off the async runtime.
    pub async fn with_reports_conn<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let conn = me.reports.lock().unwrap_or_else(|e| e.into_inner());
            f(&conn)
        })
        .await
        .context("database task panicked")?
    }

    /// Looks the key up on every request (no cache), so revocation takes effect at once.
    pub async fn authenticate(self: &Arc<Self>, key: String) -> Result<Option<Caller>> {
        let limiter = self.limiter.clone();
        self.with_conn(move |conn, secret| {
            let now = db::unix_now();
            let Some(p) = db::authenticate(conn, secret, &key, now)? else { return Ok(None) };
            let seed = |l: &limits::Limits, id: &str, is_key: bool| -> Result<u64> {
                let start = l.budget_window_start(now.max(0) as u64);
                let scope = if is_key { format!("key:{id}") } else { format!("tenant:{id}") };
                if l.token_budget.is_none() || limiter.budget_seeded(&scope, start) {
                    return Ok(0);
                }
                db::tokens_since(conn, id, is_key, start as i64)
            };
            let t = seed(&p.tenant.settings.limits, &p.tenant.id, false)?;
            let k = seed(&p.key.settings.limits, &p.key.id, true)?;
            Ok(Some(Caller { principal: p, budget_used: (t, k) }))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_usage_report_does_not_hold_up_key_checks() {
        let dir = std::env::temp_dir().join(format!("wasmserve-tenancy-{}-reports", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let t = Tenancy::open(&dir.join("t.db"), None, None).unwrap();
        let key = t
            .with_conn(|c, secret| {
                db::create_tenant(c, "slow-reader", 1.0, &db::Settings::default())?;
                Ok(db::create_key(c, secret, "slow-reader", None, None, &db::Settings::default())?.1)
            })
            .await
            .unwrap();
        // A report that runs until released, standing in for one over millions of rows.
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (started, report_running) = tokio::sync::oneshot::channel();
        let report = tokio::spawn({
            let t = t.clone();
            async move {
                t.with_reports_conn(move |c| {
                    let _ = started.send(());
                    wait.recv().ok();
                    db::query_usage(c, &db::UsageQuery { tenant: Some("slow-reader".into()), ..Default::default() })
                })
                .await
            }
        });
        report_running.await.unwrap();
        let caller = tokio::time::timeout(Duration::from_secs(10), t.authenticate(key)).await;
        release.send(()).unwrap();
        let caller = caller.expect("authentication waited for the usage report").unwrap();
        assert_eq!(caller.expect("valid key").principal.tenant.id, "slow-reader");
        let (rows, totals) = report.await.unwrap().unwrap();
        assert!(rows.is_empty() && totals.requests == 0);
    }
}
