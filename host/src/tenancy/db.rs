//! The tenancy database (SQLite): tenants, API keys and per-request usage, created and migrated
//! on open (`PRAGMA user_version` counts the applied migrations).
//!
//! Durability: WAL with `synchronous=FULL`. Every usage row is committed (and fsynced) before
//! the response that it accounts for completes, so a `kill -9` (or power loss) never loses a
//! row of a completed request. FULL costs an fsync per commit; the usage writer commits rows in
//! groups (everything queued while the previous commit ran), which keeps that cheap under load.
//! (NORMAL would survive a process kill too, but not an OS crash.)

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::{Deserialize, Serialize};

use super::keys;
use super::limits::Limits;

const MIGRATIONS: &[&str] = &[
    // 1: tenants, keys, usage.
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
     CREATE TABLE tenants (
        id TEXT PRIMARY KEY,
        weight REAL NOT NULL DEFAULT 1.0,
        models TEXT,
        request_policy TEXT,
        parser TEXT,
        rpm INTEGER, tpm INTEGER, max_concurrent INTEGER, max_context INTEGER,
        token_budget INTEGER, budget_window_secs INTEGER,
        created_at INTEGER NOT NULL,
        disabled_at INTEGER
     );
     CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id),
        name TEXT,
        key_hash BLOB NOT NULL,
        models TEXT,
        request_policy TEXT,
        parser TEXT,
        rpm INTEGER, tpm INTEGER, max_concurrent INTEGER, max_context INTEGER,
        token_budget INTEGER, budget_window_secs INTEGER,
        created_at INTEGER NOT NULL,
        expires_at INTEGER,
        revoked_at INTEGER
     );
     CREATE INDEX api_keys_tenant ON api_keys(tenant_id);
     CREATE TABLE usage (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts INTEGER NOT NULL,
        request_id TEXT NOT NULL,
        tenant_id TEXT NOT NULL,
        key_id TEXT NOT NULL,
        model TEXT NOT NULL,
        endpoint TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        cached_tokens INTEGER NOT NULL,
        latency_ms INTEGER NOT NULL,
        status TEXT NOT NULL
     );
     CREATE INDEX usage_tenant_ts ON usage(tenant_id, ts);
     CREATE INDEX usage_key_ts ON usage(key_id, ts);",
];

pub fn open(path: &Path) -> Result<Connection> {
    let conn = Connection::open(path).with_context(|| format!("opening the database {}", path.display()))?;
    conn.busy_timeout(Duration::from_secs(10))?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        bail!("{}: could not switch to WAL (journal_mode is {mode})", path.display());
    }
    conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")?;
    migrate(&conn).with_context(|| format!("migrating {}", path.display()))?;
    Ok(conn)
}

fn migrate(conn: &Connection) -> Result<()> {
    // IMMEDIATE: two processes opening a fresh file at once migrate one after the other.
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let run = || -> Result<()> {
        let version: usize = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > MIGRATIONS.len() {
            bail!("the database is at schema version {version}, newer than this binary ({})", MIGRATIONS.len());
        }
        for (i, m) in MIGRATIONS.iter().enumerate().skip(version) {
            conn.execute_batch(m).with_context(|| format!("migration {}", i + 1))?;
            conn.execute_batch(&format!("PRAGMA user_version = {}", i + 1))?;
        }
        Ok(())
    };
    match run() {
        Ok(()) => Ok(conn.execute_batch("COMMIT")?),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}

/// The HMAC secret for key hashes: `explicit` (flag / env) if given, else a random one stored in
/// the database the first time (the CLI and the server then agree without configuration).
pub fn key_secret(conn: &Connection, explicit: Option<&str>) -> Result<Vec<u8>> {
    if let Some(s) = explicit.filter(|s| !s.is_empty()) {
        return Ok(s.as_bytes().to_vec());
    }
    conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('key_secret', ?1)", [keys::random_hex(32)])?;
    let v: String = conn.query_row("SELECT value FROM meta WHERE key = 'key_secret'", [], |r| r.get(0))?;
    Ok(v.into_bytes())
}

pub fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// Which plugins apply: names only (the plugin system resolves them).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    #[serde(flatten)]
    pub limits: Limits,
    /// Models this scope may use; `None` is all.
    pub models: Option<Vec<String>>,
    pub request_policy: Option<String>,
    pub parser: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Tenant {
    pub id: String,
    pub weight: f64,
    #[serde(flatten)]
    pub settings: Settings,
    pub created_at: i64,
    pub disabled_at: Option<i64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ApiKey {
    pub id: String,
    pub tenant_id: String,
    pub name: Option<String>,
    #[serde(flatten)]
    pub settings: Settings,
    pub created_at: i64,
    pub expires_at: Option<i64>,
    pub revoked_at: Option<i64>,
}

const SETTINGS_COLS: &str =
    "models, request_policy, parser, rpm, tpm, max_concurrent, max_context, token_budget, budget_window_secs";

fn opt_u64(r: &Row, col: &str) -> rusqlite::Result<Option<u64>> {
    Ok(r.get::<_, Option<i64>>(col)?.map(|v| v.max(0) as u64))
}

fn settings_from(r: &Row) -> rusqlite::Result<Settings> {
    let models: Option<String> = r.get("models")?;
    Ok(Settings {
        limits: Limits {
            rpm: opt_u64(r, "rpm")?,
            tpm: opt_u64(r, "tpm")?,
            max_concurrent: opt_u64(r, "max_concurrent")?,
            max_context: opt_u64(r, "max_context")?,
            token_budget: opt_u64(r, "token_budget")?,
            budget_window_secs: opt_u64(r, "budget_window_secs")?,
        },
        models: models.and_then(|m| serde_json::from_str(&m).ok()),
        request_policy: r.get("request_policy")?,
        parser: r.get("parser")?,
    })
}

fn settings_params(s: &Settings) -> [rusqlite::types::Value; 9] {
    use rusqlite::types::Value as V;
    let n = |v: Option<u64>| v.map_or(V::Null, |x| V::Integer(x.min(i64::MAX as u64) as i64));
    let t = |v: &Option<String>| v.clone().map_or(V::Null, V::Text);
    let l = &s.limits;
    [
        s.models.as_ref().map_or(V::Null, |m| V::Text(serde_json::to_string(m).unwrap_or_default())),
        t(&s.request_policy),
        t(&s.parser),
        n(l.rpm),
        n(l.tpm),
        n(l.max_concurrent),
        n(l.max_context),
        n(l.token_budget),
        n(l.budget_window_secs),
    ]
}

fn tenant_from(r: &Row) -> rusqlite::Result<Tenant> {
    Ok(Tenant {
        id: r.get("id")?,
        weight: r.get("weight")?,
        settings: settings_from(r)?,
        created_at: r.get("created_at")?,
        disabled_at: r.get("disabled_at")?,
    })
}

fn key_from(r: &Row) -> rusqlite::Result<ApiKey> {
    Ok(ApiKey {
        id: r.get("id")?,
        tenant_id: r.get("tenant_id")?,
        name: r.get("name")?,
        settings: settings_from(r)?,
        created_at: r.get("created_at")?,
        expires_at: r.get("expires_at")?,
        revoked_at: r.get("revoked_at")?,
    })
}

fn valid_tenant_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.@".contains(&c))
}

pub fn create_tenant(conn: &Connection, id: &str, weight: f64, settings: &Settings) -> Result<Tenant> {
    if !valid_tenant_id(id) {
        bail!("tenant id '{id}' must be 1-128 characters of letters, digits, '-', '_', '.', '@'");
    }
    if !(weight.is_finite() && weight > 0.0) {
        bail!("tenant weight must be a positive number");
    }
    if get_tenant(conn, id)?.is_some() {
        bail!("tenant '{id}' already exists");
    }
    let p = settings_params(settings);
    conn.execute(
        &format!("INSERT INTO tenants (id, weight, created_at, {SETTINGS_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"),
        rusqlite::params_from_iter(
            [rusqlite::types::Value::Text(id.into()), weight.into(), unix_now().into()].into_iter().chain(p),
        ),
    )?;
    Ok(get_tenant(conn, id)?.expect("just inserted"))
}

pub fn get_tenant(conn: &Connection, id: &str) -> Result<Option<Tenant>> {
    Ok(conn.query_row("SELECT * FROM tenants WHERE id = ?1", [id], tenant_from).optional()?)
}

pub fn list_tenants(conn: &Connection) -> Result<Vec<Tenant>> {
    let mut st = conn.prepare("SELECT * FROM tenants ORDER BY created_at, id")?;
    let rows = st.query_map([], tenant_from)?.collect::<rusqlite::Result<_>>()?;
    Ok(rows)
}

/// Disables a tenant: all its keys stop working at once. False if unknown or already disabled.
pub fn disable_tenant(conn: &Connection, id: &str) -> Result<bool> {
    Ok(conn.execute(
        "UPDATE tenants SET disabled_at = ?2 WHERE id = ?1 AND disabled_at IS NULL",
        params![id, unix_now()],
    )? == 1)
}

/// A new key's expiry from `expires_at` (Unix seconds) or `expires_in` (seconds from now, at
/// least 1). An explicit `expires_at` may lie in the past (a key born expired, for tests and
/// hand-overs); one past the year 9999, or an `expires_in` that would overflow, is refused
/// instead of wrapping to a negative expiry.
pub fn key_expiry(expires_at: Option<i64>, expires_in: Option<i64>) -> Result<Option<i64>> {
    const MAX_UNIX: i64 = 253_402_300_799; // 9999-12-31T23:59:59Z
    let now = unix_now();
    let at = match (expires_at, expires_in) {
        (Some(_), Some(_)) => bail!("give 'expires_at' or 'expires_in', not both"),
        (Some(at), None) => at,
        (None, Some(secs)) if secs <= 0 => bail!("'expires_in' must be a positive number of seconds, got {secs}"),
        (None, Some(secs)) => now
            .checked_add(secs)
            .filter(|&at| at <= MAX_UNIX)
            .ok_or_else(|| anyhow::anyhow!("'expires_in' of {secs} seconds is past the year 9999"))?,
        (None, None) => return Ok(None),
    };
    if at > MAX_UNIX {
        bail!("the expiry {at} (Unix seconds) is past the year 9999");
    }
    Ok(Some(at))
}

/// Creates a key; returns its row and the key itself (shown once, never stored).
pub fn create_key(
    conn: &Connection,
    secret: &[u8],
    tenant_id: &str,
    name: Option<&str>,
    expires_at: Option<i64>,
    settings: &Settings,
) -> Result<(ApiKey, String)> {
    match get_tenant(conn, tenant_id)? {
        None => bail!("no tenant '{tenant_id}'"),
        Some(t) if t.disabled_at.is_some() => bail!("tenant '{tenant_id}' is disabled"),
        Some(_) => {}
    }
    let (id, key) = keys::generate();
    let h = keys::hash(secret, &key);
    use rusqlite::types::Value as V;
    let head = [
        V::Text(id.clone()),
        V::Text(tenant_id.into()),
        name.map_or(V::Null, |n| V::Text(n.into())),
        V::Blob(h),
        V::Integer(unix_now()),
        expires_at.map_or(V::Null, V::Integer),
    ];
    conn.execute(
        &format!(
            "INSERT INTO api_keys (id, tenant_id, name, key_hash, created_at, expires_at, {SETTINGS_COLS})
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)"
        ),
        rusqlite::params_from_iter(head.into_iter().chain(settings_params(settings))),
    )?;
    let row = conn.query_row("SELECT * FROM api_keys WHERE id = ?1", [&id], key_from)?;
    Ok((row, key))
}

pub fn list_keys(conn: &Connection, tenant_id: Option<&str>) -> Result<Vec<ApiKey>> {
    let mut st = conn.prepare("SELECT * FROM api_keys WHERE ?1 IS NULL OR tenant_id = ?1 ORDER BY created_at, id")?;
    let rows = st.query_map([tenant_id], key_from)?.collect::<rusqlite::Result<_>>()?;
    Ok(rows)
}

/// Revokes a key at once. False if unknown or already revoked.
pub fn revoke_key(conn: &Connection, id: &str) -> Result<bool> {
    Ok(conn
        .execute("UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL", params![id, unix_now()])?
        == 1)
}

/// A key that authenticated, with its tenant.
#[derive(Clone, Debug)]
pub struct Principal {
    pub tenant: Tenant,
    pub key: ApiKey,
}

impl Principal {
    /// Whether both the tenant and the key allow `model`.
    pub fn allows_model(&self, model: &str) -> bool {
        [&self.tenant.settings.models, &self.key.settings.models]
            .iter()
            .all(|m| m.as_ref().is_none_or(|m| m.iter().any(|x| x == model)))
    }

    /// The plugin binding: the key's, falling back to the tenant's.
    pub fn request_policy(&self) -> Option<&str> {
        self.key.settings.request_policy.as_deref().or(self.tenant.settings.request_policy.as_deref())
    }

    pub fn parser(&self) -> Option<&str> {
        self.key.settings.parser.as_deref().or(self.tenant.settings.parser.as_deref())
    }
}

/// The tenant and key of a valid, unrevoked, unexpired key of an enabled tenant; `None` for any
/// other key (the caller answers 401 without saying which check failed).
pub fn authenticate(conn: &Connection, secret: &[u8], key: &str, now: i64) -> Result<Option<Principal>> {
    let Some(id) = keys::key_id(key) else { return Ok(None) };
    let row = conn
        .query_row("SELECT * FROM api_keys WHERE id = ?1", [id], |r| {
            Ok((key_from(r)?, r.get::<_, Vec<u8>>("key_hash")?))
        })
        .optional()?;
    let Some((k, hash)) = row else { return Ok(None) };
    if !keys::verify(secret, key, &hash) || k.revoked_at.is_some() || k.expires_at.is_some_and(|e| e <= now) {
        return Ok(None);
    }
    let Some(t) = get_tenant(conn, &k.tenant_id)? else { return Ok(None) };
    if t.disabled_at.is_some() {
        return Ok(None);
    }
    Ok(Some(Principal { tenant: t, key: k }))
}

/// One request's usage row.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct UsageRow {
    pub ts: i64,
    pub request_id: String,
    pub tenant_id: String,
    pub key_id: String,
    pub model: String,
    pub endpoint: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub latency_ms: u64,
    /// `ok`, `error` or `aborted` (the client went away).
    pub status: String,
}

pub fn insert_usage(conn: &Connection, rows: &[UsageRow]) -> Result<()> {
    let tx = conn.unchecked_transaction()?;
    {
        let mut st = tx.prepare_cached(
            "INSERT INTO usage (ts, request_id, tenant_id, key_id, model, endpoint, prompt_tokens, completion_tokens, cached_tokens, latency_ms, status)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        )?;
        for u in rows {
            st.execute(params![
                u.ts,
                u.request_id,
                u.tenant_id,
                u.key_id,
                u.model,
                u.endpoint,
                u.prompt_tokens as i64,
                u.completion_tokens as i64,
                u.cached_tokens as i64,
                u.latency_ms as i64,
                u.status
            ])?;
        }
    }
    tx.commit()?;
    Ok(())
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct UsageQuery {
    pub tenant: Option<String>,
    pub key_id: Option<String>,
    /// Unix seconds, inclusive.
    pub since: Option<i64>,
    pub until: Option<i64>,
    /// Rows returned at most (newest first); the totals cover every matching row.
    pub limit: Option<u64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct UsageTotals {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub total_tokens: u64,
}

pub fn query_usage(conn: &Connection, q: &UsageQuery) -> Result<(Vec<UsageRow>, UsageTotals)> {
    const WHERE: &str = "WHERE (?1 IS NULL OR tenant_id = ?1) AND (?2 IS NULL OR key_id = ?2) AND (?3 IS NULL OR ts >= ?3) AND (?4 IS NULL OR ts <= ?4)";
    let p = params![q.tenant, q.key_id, q.since, q.until];
    let totals = conn.query_row(
        &format!("SELECT COUNT(*), COALESCE(SUM(prompt_tokens),0), COALESCE(SUM(completion_tokens),0), COALESCE(SUM(cached_tokens),0) FROM usage {WHERE}"),
        p,
        |r| {
            let (n, pt, ct, ca): (i64, i64, i64, i64) = (r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?);
            Ok(UsageTotals {
                requests: n as u64,
                prompt_tokens: pt as u64,
                completion_tokens: ct as u64,
                cached_tokens: ca as u64,
                total_tokens: (pt + ct) as u64,
            })
        },
    )?;
    let limit = q.limit.unwrap_or(1000).min(100_000) as i64;
    let mut st = conn.prepare(&format!("SELECT * FROM usage {WHERE} ORDER BY id DESC LIMIT ?5"))?;
    let rows = st
        .query_map(params![q.tenant, q.key_id, q.since, q.until, limit], |r| {
            Ok(UsageRow {
                ts: r.get("ts")?,
                request_id: r.get("request_id")?,
                tenant_id: r.get("tenant_id")?,
                key_id: r.get("key_id")?,
                model: r.get("model")?,
                endpoint: r.get("endpoint")?,
                prompt_tokens: r.get::<_, i64>("prompt_tokens")? as u64,
                completion_tokens: r.get::<_, i64>("completion_tokens")? as u64,
                cached_tokens: r.get::<_, i64>("cached_tokens")? as u64,
                latency_ms: r.get::<_, i64>("latency_ms")? as u64,
                status: r.get("status")?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    Ok((rows, totals))
}

/// Tokens a tenant (`key = false`) or key used since `since` (seeds the token budget).
pub fn tokens_since(conn: &Connection, id: &str, key: bool, since: i64) -> Result<u64> {
    let sql = if key {
        "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage WHERE key_id = ?1 AND ts >= ?2"
    } else {
        "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage WHERE tenant_id = ?1 AND ts >= ?2"
    };
    let n: i64 = conn.query_row(sql, params![id, since], |r| r.get(0))?;
    Ok(n.max(0) as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn key_expiry_never_wraps() {
        use super::key_expiry;
        assert_eq!(key_expiry(None, None).unwrap(), None);
        assert_eq!(key_expiry(Some(5), None).unwrap(), Some(5));
        let soon = key_expiry(None, Some(60)).unwrap().unwrap();
        assert!(soon > super::unix_now());
        for bad in
            [(None, Some(i64::MAX)), (None, Some(0)), (None, Some(-5)), (Some(i64::MAX), None), (Some(1), Some(1))]
        {
            assert!(key_expiry(bad.0, bad.1).is_err(), "{bad:?}");
        }
    }

    use super::*;

    fn tmp_db(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("wasmserve-tenancy-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("t.db")
    }

    #[test]
    fn keys_authenticate_until_revoked_or_expired_and_are_not_stored() {
        let path = tmp_db("auth");
        let conn = open(&path).unwrap();
        let secret = key_secret(&conn, None).unwrap();
        assert_eq!(key_secret(&open(&path).unwrap(), None).unwrap(), secret, "the stored secret is reused");
        let s = Settings {
            models: Some(vec!["m1".into()]),
            limits: Limits { rpm: Some(5), ..Default::default() },
            ..Default::default()
        };
        create_tenant(&conn, "acme", 2.0, &s).unwrap();
        assert!(create_tenant(&conn, "acme", 1.0, &s).is_err());
        let (row, key) = create_key(&conn, &secret, "acme", Some("ci"), None, &Settings::default()).unwrap();
        let now = unix_now();
        let p = authenticate(&conn, &secret, &key, now).unwrap().expect("valid key");
        assert_eq!(p.tenant.id, "acme");
        assert_eq!(p.tenant.settings.limits.rpm, Some(5));
        assert!(p.allows_model("m1") && !p.allows_model("m2"));
        assert!(authenticate(&conn, &secret, &key.replace(&row.id, "000000000000"), now).unwrap().is_none());
        assert!(authenticate(&conn, b"wrong secret", &key, now).unwrap().is_none());
        let (_, short) = create_key(&conn, &secret, "acme", None, Some(now + 100), &Settings::default()).unwrap();
        assert!(authenticate(&conn, &secret, &short, now).unwrap().is_some());
        assert!(authenticate(&conn, &secret, &short, now + 100).unwrap().is_none(), "expired");
        assert!(revoke_key(&conn, &row.id).unwrap());
        assert!(!revoke_key(&conn, &row.id).unwrap());
        assert!(authenticate(&conn, &secret, &key, now).unwrap().is_none(), "revoked");
        assert!(disable_tenant(&conn, "acme").unwrap());
        assert!(authenticate(&conn, &secret, &short, now).unwrap().is_none(), "tenant disabled");
        drop(conn);
        let bytes = std::fs::read(&path).unwrap();
        let wal = std::fs::read(path.with_extension("db-wal")).unwrap_or_default();
        for k in [&key, &short] {
            let secret_part = k.rsplit('-').next().unwrap().as_bytes();
            assert!(!bytes.windows(secret_part.len()).any(|w| w == secret_part));
            assert!(!wal.windows(secret_part.len()).any(|w| w == secret_part));
        }
    }

    #[test]
    fn usage_rows_round_trip_with_totals() {
        let conn = open(&tmp_db("usage")).unwrap();
        let row = |t: &str, p, c| UsageRow {
            ts: 100,
            request_id: "r".into(),
            tenant_id: t.into(),
            key_id: "k".into(),
            model: "m".into(),
            endpoint: "/v1/completions".into(),
            prompt_tokens: p,
            completion_tokens: c,
            cached_tokens: 0,
            latency_ms: 5,
            status: "ok".into(),
        };
        insert_usage(&conn, &[row("a", 3, 4), row("a", 1, 1), row("b", 10, 10)]).unwrap();
        let (rows, tot) = query_usage(&conn, &UsageQuery { tenant: Some("a".into()), ..Default::default() }).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((tot.requests, tot.total_tokens), (2, 9));
        assert_eq!(tokens_since(&conn, "a", false, 100).unwrap(), 9);
        assert_eq!(tokens_since(&conn, "a", false, 101).unwrap(), 0);
    }
}
