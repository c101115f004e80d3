//! `wasmserve tenants ...` and `wasmserve keys ...`: operate on the database file directly
//! (the server may be running; SQLite serialises the writes). Output is JSON on stdout.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use super::db::{self, Settings};
use super::limits::Limits;

#[derive(Args, Debug, Clone)]
pub struct DbArgs {
    /// The tenancy database (created and migrated if missing).
    #[arg(long, env = "WASMSERVE_DB")]
    pub db: PathBuf,
    /// HMAC secret for key hashes; must match the server's (default: the one stored in the database).
    #[arg(long, env = "WASMSERVE_KEY_SECRET", hide_env_values = true)]
    pub key_secret: Option<String>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct SettingsArgs {
    /// Models this tenant/key may use, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    pub models: Option<Vec<String>>,
    /// Request-policy plugin binding (a plugin name).
    #[arg(long)]
    pub request_policy: Option<String>,
    /// Output-parser plugin binding (a plugin name).
    #[arg(long)]
    pub parser: Option<String>,
    /// Requests per minute.
    #[arg(long)]
    pub rpm: Option<u64>,
    /// Tokens (prompt + completion) per minute.
    #[arg(long)]
    pub tpm: Option<u64>,
    #[arg(long)]
    pub max_concurrent: Option<u64>,
    /// Most prompt + completion tokens of one sequence.
    #[arg(long)]
    pub max_context: Option<u64>,
    /// Tokens per budget window.
    #[arg(long)]
    pub token_budget: Option<u64>,
    /// Budget window in seconds (default 86400).
    #[arg(long)]
    pub budget_window: Option<u64>,
}

impl SettingsArgs {
    fn settings(&self) -> Settings {
        Settings {
            limits: Limits {
                rpm: self.rpm,
                tpm: self.tpm,
                max_concurrent: self.max_concurrent,
                max_context: self.max_context,
                token_budget: self.token_budget,
                budget_window_secs: self.budget_window,
            },
            models: self.models.clone(),
            request_policy: self.request_policy.clone(),
            parser: self.parser.clone(),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum TenantsCommand {
    /// Create a tenant.
    Create {
        id: String,
        /// Share of batch slots relative to other tenants.
        #[arg(long, default_value_t = 1.0)]
        weight: f64,
        #[command(flatten)]
        settings: SettingsArgs,
        #[command(flatten)]
        db: DbArgs,
    },
    /// List tenants.
    List {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Disable a tenant: its keys stop working at once.
    Disable {
        id: String,
        #[command(flatten)]
        db: DbArgs,
    },
}

#[derive(Subcommand, Debug)]
// Parsed once per command line.
#[allow(clippy::large_enum_variant)]
pub enum KeysCommand {
    /// Create a key; it is printed once and stored only as a hash.
    Create {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        name: Option<String>,
        /// Expiry in seconds from now.
        #[arg(long, conflicts_with = "expires_at")]
        expires_in: Option<i64>,
        /// Expiry as Unix seconds.
        #[arg(long)]
        expires_at: Option<i64>,
        #[command(flatten)]
        settings: SettingsArgs,
        #[command(flatten)]
        db: DbArgs,
    },
    /// List keys (never the keys themselves).
    List {
        #[arg(long)]
        tenant: Option<String>,
        #[command(flatten)]
        db: DbArgs,
    },
    /// Revoke a key by id; takes effect on the next request.
    Revoke {
        id: String,
        #[command(flatten)]
        db: DbArgs,
    },
}

fn print(v: serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
}

pub fn tenants(cmd: TenantsCommand) -> Result<()> {
    match cmd {
        TenantsCommand::Create { id, weight, settings, db } => {
            let conn = db::open(&db.db)?;
            print(serde_json::to_value(db::create_tenant(&conn, &id, weight, &settings.settings())?)?);
        }
        TenantsCommand::List { db } => print(serde_json::to_value(db::list_tenants(&db::open(&db.db)?)?)?),
        TenantsCommand::Disable { id, db } => {
            if !db::disable_tenant(&db::open(&db.db)?, &id)? {
                bail!("no enabled tenant '{id}'");
            }
            print(json!({"id": id, "disabled": true}));
        }
    }
    Ok(())
}

pub fn keys(cmd: KeysCommand) -> Result<()> {
    match cmd {
        KeysCommand::Create { tenant, name, expires_in, expires_at, settings, db } => {
            let conn = db::open(&db.db)?;
            let secret = db::key_secret(&conn, db.key_secret.as_deref())?;
            let expires = db::key_expiry(expires_at, expires_in)?;
            let (row, key) = db::create_key(&conn, &secret, &tenant, name.as_deref(), expires, &settings.settings())?;
            let mut v = serde_json::to_value(row)?;
            v["key"] = key.into();
            eprintln!("store the key now: it is not shown again");
            print(v);
        }
        KeysCommand::List { tenant, db } => {
            print(serde_json::to_value(db::list_keys(&db::open(&db.db)?, tenant.as_deref())?)?)
        }
        KeysCommand::Revoke { id, db } => {
            if !db::revoke_key(&db::open(&db.db)?, &id)? {
                bail!("no unrevoked key '{id}'");
            }
            print(json!({"id": id, "revoked": true}));
        }
    }
    Ok(())
}
