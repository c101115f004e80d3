//! The admin API, behind the admin key: tenants, keys and usage (`tenants`, with `--db`) and
//! plugin deployments (`plugins`, with a plugin registry).

pub mod plugins;
pub mod tenants;
