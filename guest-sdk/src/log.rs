//! Logging through the host's `logging` import (natively: stderr, for tests).

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    crate::glue::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("[plugin {level:?}] {message}");
}
