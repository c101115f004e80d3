//! Server-sent events for streaming responses: one `data: {json}` event per chunk, an optional
//! usage chunk, then `data: [DONE]`.
//!
//! A task pumps the events into a small channel that the response body drains. The task owns
//! the `Generation` (and the formatter with its parser plugin sessions), and drops them, which
//! aborts the engine request, as soon as the client hangs up or stops reading: a client that
//! keeps the connection open without reading would otherwise hold its plugin instances, its
//! tenant's concurrency slot and the shutdown drain for as long as it liked.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::SendTimeoutError;

use super::error::ApiError;
use super::generation::{GenEvent, Generation, Usage};
use super::state::AppState;
use super::token_ids::StreamTokenIds;

/// Turns generation events into the endpoint's chunk objects.
pub trait ChunkFormatter: Send + 'static {
    /// Chunks sent before any token (chat announces the assistant role per choice).
    fn start(&mut self, _choices: usize) -> Vec<Value> {
        Vec::new()
    }
    /// The chunk for one token, or none (nothing to show: text held back, no logprobs).
    fn token(&mut self, ev: &GenEvent) -> Option<Value>;
    /// The chunks a prompt's scores complete (`GenEvent::PromptLogprobs`: an echo held back
    /// for them); only requests that score the prompt get the event.
    fn prompt_logprobs(&mut self, _ev: &GenEvent) -> Vec<Value> {
        Vec::new()
    }
    /// The chunk(s) ending a choice (`GenEvent::Finished`).
    fn finish(&mut self, ev: &GenEvent) -> Vec<Value>;
    /// The final usage-only chunk (`stream_options.include_usage`).
    fn usage(&mut self, usage: &Usage) -> Value;
    /// An error that ends the stream after the chunks already queued (a plugin failed).
    fn take_error(&mut self) -> Option<ApiError> {
        None
    }
    /// Whether `token` / `finish` call plugins (parsers): they then run on the plugin pool.
    fn uses_plugins(&self) -> bool {
        false
    }
}

struct StreamState<F> {
    gen: Option<Generation>,
    /// Taken while a call runs on the plugin pool; None after that call failed.
    fmt: Option<F>,
    out: Outbox,
    state: AppState,
}

/// Runs a formatter call: on the plugin pool (`blocking::PluginCalls`) when the formatter calls
/// plugins, so guest code never runs on an async worker; here otherwise.
async fn with_fmt<F: ChunkFormatter, T: Send + 'static>(
    state: &AppState,
    slot: &mut Option<F>,
    call: impl FnOnce(&mut F) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let mut fmt = slot.take().ok_or_else(|| ApiError::internal("the stream's formatter was lost"))?;
    if !fmt.uses_plugins() {
        let out = call(&mut fmt);
        *slot = Some(fmt);
        return Ok(out);
    }
    let (fmt, out) = state
        .plugin_calls
        .run(move || {
            let out = call(&mut fmt);
            (fmt, out)
        })
        .await?;
    *slot = Some(fmt);
    Ok(out)
}

/// What a stream adds to its chunks beyond the endpoint's own fields.
pub struct StreamSettings {
    /// `stream_options.include_usage`: a final usage chunk (and `"usage": null` on the others).
    pub include_usage: bool,
    /// vLLM's `continuous_usage_stats`: the usage so far on every chunk instead of null.
    pub continuous_usage: bool,
    /// `return_token_ids`: adds the ids to each chunk.
    pub token_ids: Option<StreamTokenIds>,
}

/// Events ready to go out, and what every chunk gets on its way there.
struct Outbox {
    pending: VecDeque<Event>,
    settings: StreamSettings,
}

impl Outbox {
    /// Queues a chunk of `gen` (whose usage so far continuous usage stats report).
    fn push_chunk(&mut self, mut chunk: Value, gen: &Generation) {
        if let Some(ids) = &mut self.settings.token_ids {
            ids.annotate(&mut chunk);
        }
        if self.settings.continuous_usage {
            chunk["usage"] = gen.usage_so_far().to_json();
        }
        self.pending.push_back(data(chunk, self.settings.include_usage));
    }
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

/// Events queued between the generation and the socket. Small: the socket's own buffers
/// absorb bursts, and a full queue is what reveals a client that stopped reading.
const QUEUE_EVENTS: usize = 16;

pub fn stream_response<F: ChunkFormatter>(gen: Generation, fmt: F, settings: StreamSettings) -> Response {
    let state = gen.state().clone();
    let stall = state.stream_stall_timeout;
    let events = chunk_events(gen, fmt, settings);
    let (tx, rx) = mpsc::channel(QUEUE_EVENTS);
    tokio::spawn(async move {
        if pump(events, tx, stall).await == PumpEnd::Stalled {
            state.metrics.stalled_streams.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                timeout_s = stall.map_or(0.0, |d| d.as_secs_f64()),
                "the client stopped reading the stream: request aborted"
            );
        }
    });
    let body = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok::<Event, Infallible>(e), rx)) });
    Sse::new(body).into_response()
}

#[derive(Debug, PartialEq)]
enum PumpEnd {
    /// Every event was queued.
    Done,
    /// The body was dropped: the client hung up.
    ClientGone,
    /// The queue stayed full for the stall timeout: the client stopped reading.
    Stalled,
}

/// Moves events into the body's queue until they run out, the client hangs up (noticed even
/// while waiting for the next token), or one event cannot be queued within `stall`. Dropping
/// `events` on return is what aborts an unfinished generation.
async fn pump<S: Stream<Item = Event>>(events: S, tx: mpsc::Sender<Event>, stall: Option<Duration>) -> PumpEnd {
    let mut events = std::pin::pin!(events);
    loop {
        let next = tokio::select! {
            biased;
            _ = tx.closed() => return PumpEnd::ClientGone,
            e = events.next() => e,
        };
        let Some(e) = next else { return PumpEnd::Done };
        let sent = match stall {
            Some(d) => tx.send_timeout(e, d).await.map_err(|err| matches!(err, SendTimeoutError::Timeout(_))),
            None => tx.send(e).await.map_err(|_| false),
        };
        match sent {
            Ok(()) => {}
            Err(true) => return PumpEnd::Stalled,
            Err(false) => return PumpEnd::ClientGone,
        }
    }
}

/// The response's events, in order: the formatter's start chunks, a chunk per token, the finish
/// chunks, an error event if the request failed, the usage chunk and `[DONE]`.
fn chunk_events<F: ChunkFormatter>(
    gen: Generation,
    mut fmt: F,
    settings: StreamSettings,
) -> impl Stream<Item = Event> + Send {
    let mut out = Outbox { pending: VecDeque::new(), settings };
    for c in fmt.start(gen.num_choices()) {
        out.push_chunk(c, &gen);
    }
    let state = gen.state().clone();
    let st = StreamState { gen: Some(gen), fmt: Some(fmt), out, state };
    stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.out.pending.pop_front() {
                return Some((e, st));
            }
            let gen = st.gen.as_mut()?;
            let failure = match gen.next().await {
                Some(ev @ GenEvent::Token { .. }) => {
                    if let (Some(ids), GenEvent::Token { choice, token, .. }) = (&mut st.out.settings.token_ids, &ev) {
                        ids.token(*choice, *token);
                    }
                    match with_fmt(&st.state, &mut st.fmt, move |f| (f.token(&ev), f.take_error())).await {
                        Ok((chunk, error)) => {
                            if let Some(c) = chunk {
                                st.out.push_chunk(c, gen);
                            }
                            error
                        }
                        Err(e) => Some(e),
                    }
                }
                Some(ev @ GenEvent::Finished { .. }) => {
                    match with_fmt(&st.state, &mut st.fmt, move |f| (f.finish(&ev), f.take_error())).await {
                        Ok((chunks, error)) => {
                            for c in chunks {
                                st.out.push_chunk(c, gen);
                            }
                            error
                        }
                        Err(e) => Some(e),
                    }
                }
                Some(ev @ GenEvent::PromptLogprobs { .. }) => {
                    match with_fmt(&st.state, &mut st.fmt, move |f| f.prompt_logprobs(&ev)).await {
                        Ok(chunks) => {
                            for c in chunks {
                                st.out.push_chunk(c, gen);
                            }
                            None
                        }
                        Err(e) => Some(e),
                    }
                }
                Some(GenEvent::Error(msg)) => Some(ApiError::internal(format!("generation failed: {msg}"))),
                None => {
                    // The usage row is committed before the stream ends.
                    if let Err(e) = gen.settle().await {
                        tracing::warn!(message = %e.message, "stream failed");
                        st.out.pending.push_back(Event::default().data(e.body().to_string()));
                    }
                    if let (true, Some(fmt)) = (st.out.settings.include_usage, st.fmt.as_mut()) {
                        let u = fmt.usage(&gen.usage());
                        st.out.pending.push_back(Event::default().data(u.to_string()));
                    }
                    st.out.pending.push_back(Event::default().data("[DONE]"));
                    st.gen = None;
                    continue;
                }
            };
            if let Some(err) = failure {
                // The error event, the request settled (its usage row committed), `[DONE]`;
                // dropping the generation then aborts the engine request.
                tracing::warn!(message = %err.message, "stream failed");
                st.out.pending.push_back(Event::default().data(err.body().to_string()));
                let _ = gen.settle().await;
                st.out.pending.push_back(Event::default().data("[DONE]"));
                st.gen = None;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;

    /// Sets its flag when dropped: stands for the generation the event stream owns.
    struct DropFlag(Arc<AtomicBool>);
    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn owning<S: Stream<Item = Event> + Send + 'static>(s: S) -> (impl Stream<Item = Event> + Send, Arc<AtomicBool>) {
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = DropFlag(dropped.clone());
        (
            s.inspect(move |_| {
                let _ = &flag;
            }),
            dropped,
        )
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_off_after_the_stall_timeout() {
        let (events, dropped) = owning(stream::repeat_with(|| Event::default().data("x")));
        let (tx, _rx_never_read) = mpsc::channel(2);
        let t = Instant::now();
        assert_eq!(pump(events, tx, Some(Duration::from_millis(100))).await, PumpEnd::Stalled);
        assert!(t.elapsed() >= Duration::from_millis(100) && t.elapsed() < Duration::from_secs(5));
        assert!(dropped.load(Ordering::SeqCst), "the generation must be dropped (aborted)");
    }

    #[tokio::test]
    async fn a_hang_up_is_noticed_while_waiting_for_the_next_token() {
        let (events, dropped) = owning(stream::iter([Event::default().data("first")]).chain(stream::pending()));
        let (tx, mut rx) = mpsc::channel(2);
        let task = tokio::spawn(pump(events, tx, None));
        assert!(rx.recv().await.is_some());
        drop(rx);
        let end =
            tokio::time::timeout(Duration::from_secs(5), task).await.expect("pump must notice the hang-up").unwrap();
        assert_eq!(end, PumpEnd::ClientGone);
        assert!(dropped.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_reading_client_gets_every_event_however_slowly_it_reads() {
        let (events, _) = owning(stream::iter((0..40).map(|i| Event::default().data(i.to_string()))));
        let (tx, mut rx) = mpsc::channel(2);
        let task = tokio::spawn(pump(events, tx, Some(Duration::from_millis(200))));
        let mut got = 0;
        while let Some(_e) = rx.recv().await {
            got += 1;
            // Slower than the producer but well within the stall timeout per event.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(got, 40);
        assert_eq!(task.await.unwrap(), PumpEnd::Done);
    }
}
