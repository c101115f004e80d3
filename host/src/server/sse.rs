//! Server-sent events for streaming responses: one `data: {json}` event per chunk, an optional
//! usage chunk, then `data: [DONE]`. The event stream owns the `Generation`, so when hyper drops
//! the body (the client hung up) the engine request is aborted.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::Value;

use super::error::ApiError;
use super::generation::{GenEvent, Generation, Usage};

/// Turns generation events into the endpoint's chunk objects.
pub trait ChunkFormatter: Send + 'static {
    /// Chunks sent before any token (chat announces the assistant role per choice).
    fn start(&mut self, _choices: usize) -> Vec<Value> {
        Vec::new()
    }
    /// The chunk for one token, or none (nothing to show: text held back, no logprobs).
    fn token(&mut self, ev: &GenEvent) -> Option<Value>;
    /// The chunk(s) ending a choice (`GenEvent::Finished`).
    fn finish(&mut self, ev: &GenEvent) -> Vec<Value>;
    /// The final usage-only chunk (`stream_options.include_usage`).
    fn usage(&mut self, usage: &Usage) -> Value;
    /// An error that ends the stream after the chunks already queued (a plugin failed).
    fn take_error(&mut self) -> Option<ApiError> {
        None
    }
}

struct StreamState<F> {
    gen: Option<Generation>,
    fmt: F,
    include_usage: bool,
    pending: VecDeque<Event>,
}

fn data(mut v: Value, include_usage: bool) -> Event {
    // With include_usage, OpenAI puts `"usage": null` on every chunk but the last.
    if include_usage {
        if let Value::Object(o) = &mut v {
            o.entry("usage").or_insert(Value::Null);
        }
    }
    Event::default().data(v.to_string())
}

pub fn stream_response<F: ChunkFormatter>(gen: Generation, mut fmt: F, include_usage: bool) -> Response {
    let mut pending: VecDeque<Event> = VecDeque::new();
    for c in fmt.start(gen.num_choices()) {
        pending.push_back(data(c, include_usage));
    }
    let st = StreamState { gen: Some(gen), fmt, include_usage, pending };
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok::<Event, Infallible>(e), st));
            }
            let gen = st.gen.as_mut()?;
            match gen.next().await {
                Some(ev @ GenEvent::Token { .. }) => {
                    if let Some(c) = st.fmt.token(&ev) {
                        st.pending.push_back(data(c, st.include_usage));
                    }
                    if let Some(err) = st.fmt.take_error() {
                        // Dropping the generation aborts the engine request.
                        tracing::warn!(message = %err.message, "stream failed");
                        st.pending.push_back(Event::default().data(err.body().to_string()));
                        let _ = gen.settle().await;
                        st.pending.push_back(Event::default().data("[DONE]"));
                        st.gen = None;
                    }
                }
                Some(ev @ GenEvent::Finished { .. }) => {
                    for c in st.fmt.finish(&ev) {
                        st.pending.push_back(data(c, st.include_usage));
                    }
                    if let Some(err) = st.fmt.take_error() {
                        tracing::warn!(message = %err.message, "stream failed");
                        st.pending.push_back(Event::default().data(err.body().to_string()));
                        let _ = gen.settle().await;
                        st.pending.push_back(Event::default().data("[DONE]"));
                        st.gen = None;
                    }
                }
                Some(GenEvent::Error(msg)) => {
                    let err = ApiError::internal(format!("generation failed: {msg}"));
                    tracing::warn!(message = %err.message, "stream failed");
                    st.pending.push_back(Event::default().data(err.body().to_string()));
                    let _ = gen.settle().await;
                    st.pending.push_back(Event::default().data("[DONE]"));
                    st.gen = None;
                }
                None => {
                    // The usage row is committed before the stream ends.
                    if let Err(e) = gen.settle().await {
                        tracing::warn!(message = %e.message, "stream failed");
                        st.pending.push_back(Event::default().data(e.body().to_string()));
                    }
                    if st.include_usage {
                        let u = st.fmt.usage(&gen.usage());
                        st.pending.push_back(Event::default().data(u.to_string()));
                    }
                    st.pending.push_back(Event::default().data("[DONE]"));
                    st.gen = None;
                }
            }
        }
    });
    Sse::new(events).into_response()
}
