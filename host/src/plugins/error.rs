//! How a plugin call can fail, in terms the server turns into an HTTP error naming the plugin.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The call ran past its deadline (epoch interruption).
    Timeout,
    /// The guest tried to grow its memory (or tables/instances) past the store limits.
    OutOfMemory,
    /// Any other trap: `unreachable` (a guest panic), out-of-bounds access, stack overflow, ...
    Trap,
    /// The call returned, but with something the host refuses: invalid UTF-8, oversized
    /// output, malformed JSON where JSON is required, out-of-range values.
    InvalidOutput,
    /// The plugin's own error result (e.g. a template that raised).
    PluginError,
    /// Every instance of the plugin is busy and the deployment's instance cap is reached.
    Busy,
}

impl FailureKind {
    pub fn code(self) -> &'static str {
        match self {
            FailureKind::Timeout => "plugin_timeout",
            FailureKind::OutOfMemory => "plugin_out_of_memory",
            FailureKind::Trap => "plugin_trap",
            FailureKind::InvalidOutput => "plugin_invalid_output",
            FailureKind::PluginError => "plugin_error",
            FailureKind::Busy => "plugin_busy",
        }
    }

    /// HTTP status: the server's fault (500) unless the plugin answered garbage (502, it is
    /// an upstream of sorts) or is saturated (503).
    pub fn status(self) -> u16 {
        match self {
            FailureKind::InvalidOutput => 502,
            FailureKind::Busy => 503,
            FailureKind::Timeout => 504,
            _ => 500,
        }
    }
}

#[derive(Clone, Debug)]
pub struct PluginError {
    /// Deployment name (`tool-parser:hermes`, ...).
    pub plugin: String,
    pub kind: FailureKind,
    pub message: String,
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "plugin '{}' failed ({}): {}", self.plugin, self.kind.code(), self.message)
    }
}

impl std::error::Error for PluginError {}
