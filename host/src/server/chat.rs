//! `POST /v1/chat/completions`: messages → chat template → engine, answered whole or streamed.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::admission::Gate;
use super::blocking::text_bytes;
use super::error::{ApiError, ApiResult};
use super::extract::OpenAiJson;
use super::forced_call_stream::ForcedCallStream;
use super::generation::{collect, GenEvent, Usage};
use super::logprobs::{chat_entry, vllm_prompt_logprobs, TokenNames};
use super::openai::ChatCompletionRequest;
use super::sse::{stream_response, ChunkFormatter};
use super::state::{unix_now, AppState, ServerState};
use super::tenancy::{self as tenancy, CallerExt};
use super::token_ids::StreamTokenIds;
use super::tool_choice::{forced_constraint, tool_call_json};
use crate::chat_template::{ChatTemplateInput, RenderError};
use crate::engine::TokenLogprob;
use crate::model::LoadedModel;
use crate::plugins::output_parsers::{ChatParsers, StreamParsers};
use crate::sampling::constraint::ConstraintSpec;

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool", "function"];

/// Checks the messages and brings them to the shape chat templates expect, as vLLM does before
/// rendering: content parts joined into one string, an assistant's missing or null content as
/// `""`, and each tool call's `arguments` (a JSON string on the wire) as the JSON value it holds.
/// Assistant messages otherwise pass through unchanged (reasoning_content, any other field).
pub fn normalize_messages(messages: Vec<Value>) -> ApiResult<Vec<Value>> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "'messages' must contain at least one message"));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(mut m) = m else {
                return Err(ApiError::invalid_param(&format!("messages[{i}]"), format!("messages[{i}] must be an object")));
            };
            let role = match m.get("role") {
                Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.clone(),
                Some(Value::String(r)) => {
                    return Err(ApiError::invalid_param(
                        &format!("messages[{i}].role"),
                        format!("messages[{i}].role '{r}' is not one of {ROLES:?}"),
                    ))
                }
                _ => return Err(ApiError::invalid_param(&format!("messages[{i}].role"), format!("messages[{i}] needs a string 'role'"))),
            };
            let param = format!("messages[{i}].content");
            match m.get("content") {
                Some(Value::String(_)) => {}
                // An assistant turn that only called tools has no content; templates written
                // for string content concatenate it (SmolLM2's, DeepSeek's), so it becomes "".
                None | Some(Value::Null) if role == "assistant" => {
                    m.insert("content".into(), Value::String(String::new()));
                }
                None | Some(Value::Null) => return Err(ApiError::invalid_param(&param, format!("{param} is required for role '{role}'"))),
                // Templates written for string content concatenate it, so text parts are joined
                // (with newlines, as vLLM does for such templates).
                Some(Value::Array(parts)) => {
                    let mut texts = Vec::with_capacity(parts.len());
                    for (j, p) in parts.iter().enumerate() {
                        // The text kinds vLLM reads: chat's `text`, the Responses API's
                        // `input_text` / `output_text`, and an assistant's `refusal`.
                        let kind = p.get("type").and_then(Value::as_str);
                        let field = match kind {
                            Some("text" | "input_text" | "output_text") => "text",
                            Some("refusal") => "refusal",
                            Some(kind) => {
                                return Err(ApiError::not_supported(
                                    &format!("{param}[{j}]"),
                                    format!("content parts of type '{kind}' are not supported; only text ('text', 'input_text', 'output_text', 'refusal')"),
                                ))
                            }
                            None => "",
                        };
                        match p.get(field).and_then(Value::as_str) {
                            Some(t) => texts.push(t.to_string()),
                            None => {
                                return Err(ApiError::invalid_param(
                                    &format!("{param}[{j}]"),
                                    format!("{param}[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}}"),
                                ))
                            }
                        }
                    }
                    m.insert("content".into(), Value::String(texts.join("\n")));
                }
                Some(_) => return Err(ApiError::invalid_param(&param, format!("{param} must be a string or an array of content parts"))),
            }
            if role == "assistant" {
                if let Some(calls) = m.get_mut("tool_calls") {
                    decode_tool_call_arguments(calls, i)?;
                }
            }
            // Clients differ on the field name for the reasoning they echo back; templates read
            // `reasoning_content`.
            if role == "assistant" && !m.contains_key("reasoning_content") {
                if let Some(r) = m.get("reasoning").cloned() {
                    m.insert("reasoning_content".into(), r);
                }
            }
            Ok(Value::Object(m))
        })
        .collect()
}

/// An assistant message's `tool_calls`, with each `function.arguments` JSON string replaced by
/// the value it encodes (empty or absent: `{}`). Templates write arguments with `| tojson`
/// (Qwen2.5, DeepSeek-V3.1, Kimi-K2) and would otherwise quote the string a second time;
/// transformers documents dict arguments, and vLLM decodes them the same way.
fn decode_tool_call_arguments(calls: &mut Value, message: usize) -> ApiResult<()> {
    let calls = match calls {
        Value::Null => return Ok(()),
        Value::Array(calls) => calls,
        _ => {
            return Err(ApiError::invalid_param(
                &format!("messages[{message}].tool_calls"),
                format!("messages[{message}].tool_calls must be an array"),
            ))
        }
    };
    for (j, call) in calls.iter_mut().enumerate() {
        let param = format!("messages[{message}].tool_calls[{j}]");
        let Some(function) = call
            .get_mut("function")
            .and_then(Value::as_object_mut)
            .filter(|f| f.get("name").is_some_and(Value::is_string))
        else {
            return Err(ApiError::invalid_param(
                &param,
                format!(
                    "{param} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}}"
                ),
            ));
        };
        let decoded = match function.get("arguments") {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(Value::String(text)) if text.trim().is_empty() => Value::Object(Default::default()),
            Some(Value::String(text)) => serde_json::from_str(text).map_err(|e| {
                ApiError::invalid_param(
                    &format!("{param}.function.arguments"),
                    format!("{param}.function.arguments is not valid JSON: {e}"),
                )
            })?,
            Some(v @ (Value::Object(_) | Value::Array(_))) => v.clone(),
            Some(_) => {
                return Err(ApiError::invalid_param(
                    &format!("{param}.function.arguments"),
                    format!("{param}.function.arguments must be a JSON string (or an object)"),
                ))
            }
        };
        function.insert("arguments".into(), decoded);
    }
    Ok(())
}

pub fn validate_tools(tools: &[Value]) -> ApiResult<()> {
    let max = crate::engine::core::MAX_TOOLS;
    if tools.len() > max {
        return Err(ApiError::invalid_param(
            "tools",
            format!("'tools' may hold at most {max} tools, got {}", tools.len()),
        ));
    }
    for (i, t) in tools.iter().enumerate() {
        let ok = t.get("type").and_then(Value::as_str) == Some("function")
            && t.pointer("/function/name").and_then(Value::as_str).is_some();
        if !ok {
            return Err(ApiError::invalid_param(
                &format!("tools[{i}]"),
                format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ));
        }
    }
    Ok(())
}

/// [`render_chat`] on a blocking thread under the prompt-work bound (`blocking::PromptWork`,
/// weighed by the chat's text): rendering (a template plugin, too) and tokenizing a prompt of
/// megabytes takes long enough to stall every other connection on an async worker (`/health`
/// included), and many at once would multiply the server's memory.
pub async fn render_chat_off_runtime(
    state: &AppState,
    input: ChatTemplateInput,
    opts: PromptOptions,
) -> ApiResult<(String, Vec<u32>)> {
    let bytes = input.messages.iter().map(text_bytes).sum::<usize>()
        + input.tools.as_ref().map_or(0, |t| t.iter().map(text_bytes).sum());
    let st = state.clone();
    state.prompt_work.run(bytes, move || render_chat(&st, &input, opts)).await?
}

/// How a chat is rendered and becomes the prompt, beyond its messages and tools.
#[derive(Clone, Copy, Debug, Default)]
pub struct PromptOptions {
    /// The template's `add_generation_prompt`: true unless the final message is continued.
    pub add_generation_prompt: bool,
    /// vLLM's `continue_final_message`: the prompt ends inside the final message, which the
    /// model then continues (an assistant prefill), instead of after its end of turn.
    pub continue_final_message: bool,
    /// vLLM's `add_special_tokens`: off by default for chats, whose template writes them.
    pub add_special_tokens: bool,
    /// A generation's context: a rendered prompt certain to encode to more tokens is refused
    /// before it is tokenized (see [`check_prompt_size`]). None: tokenize whatever comes
    /// (`/tokenize`, or a request that truncates its prompt).
    pub max_prompt_tokens: Option<usize>,
}

/// Refuses (400 `context_length_exceeded`, naming `param`) a prompt text that cannot fit
/// `max_tokens` whatever it encodes to: its bytes over the tokenizer's longest token are already
/// too many tokens. Tokenizing megabytes first would cost seconds of CPU and gigabytes of memory
/// for the same answer.
pub fn check_prompt_size(state: &ServerState, text: &str, max_tokens: Option<usize>, param: &str) -> ApiResult<()> {
    let Some(max) = max_tokens else { return Ok(()) };
    let at_least = state.model.tokenizer.min_tokens(text.len());
    if at_least >= max {
        return Err(ApiError::bad_request(format!(
            "the prompt ({} bytes) is at least {at_least} tokens, over this model's context of {max} tokens",
            text.len()
        ))
        .with_param(param)
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// `continue_final_message`: cuts the rendered chat right after the final message's text,
/// dropping what the template writes after it (its end-of-turn). The text is matched trimmed,
/// as templates often trim content (transformers' `apply_chat_template` does the same).
fn cut_after_final_message(rendered: &str, messages: &[Value]) -> ApiResult<String> {
    let text = messages.last().and_then(|m| m.get("content")).and_then(Value::as_str).map(str::trim).unwrap_or("");
    if text.is_empty() {
        return Err(ApiError::invalid_param(
            "continue_final_message",
            "'continue_final_message' needs a final message with text to continue",
        ));
    }
    let at = rendered.rfind(text).ok_or_else(|| {
        ApiError::invalid_param(
            "continue_final_message",
            "the final message's text does not appear in the rendered chat, so it cannot be continued",
        )
    })?;
    Ok(rendered[..at + text.len()].to_string())
}

/// Renders the chat template and tokenizes the result. Special tokens come from the template
/// text itself, so by default none are added (as transformers' `apply_chat_template(tokenize=True)`).
pub fn render_chat(
    state: &ServerState,
    input: &ChatTemplateInput,
    opts: PromptOptions,
) -> ApiResult<(String, Vec<u32>)> {
    let tmpl = state
        .template
        .as_ref()
        .ok_or_else(|| ApiError::bad_request("This model has no chat template; use /v1/completions"))?;
    let prompt = tmpl.render(input).map_err(|e| match e {
        RenderError::Input(m) => ApiError::invalid_param("messages", m),
        RenderError::Renderer { status, code, message } => {
            let status =
                axum::http::StatusCode::from_u16(status).unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
            ApiError::new(status, "server_error", message).with_code(code)
        }
    })?;
    let prompt = if opts.continue_final_message { cut_after_final_message(&prompt, &input.messages)? } else { prompt };
    check_prompt_size(state, &prompt, opts.max_prompt_tokens, "messages")?;
    let ids = state.model.tokenizer.encode(&prompt, opts.add_special_tokens).map_err(ApiError::internal)?;
    Ok((prompt, ids))
}

/// The request's prompt options; a final message cannot both be continued and followed by the
/// assistant's new turn (`add_generation_prompt`, which then defaults to false).
pub fn prompt_options(
    continue_final_message: Option<bool>,
    add_generation_prompt: Option<bool>,
    add_special_tokens: Option<bool>,
) -> ApiResult<PromptOptions> {
    let continue_final_message = continue_final_message.unwrap_or(false);
    if continue_final_message && add_generation_prompt == Some(true) {
        return Err(ApiError::invalid_param(
            "continue_final_message",
            "'continue_final_message' and 'add_generation_prompt' cannot both be true",
        ));
    }
    Ok(PromptOptions {
        add_generation_prompt: add_generation_prompt.unwrap_or(!continue_final_message),
        continue_final_message,
        add_special_tokens: add_special_tokens.unwrap_or(false),
        max_prompt_tokens: None,
    })
}

/// Template variables beyond messages and tools: `reasoning_effort` and `chat_template_kwargs`.
pub fn template_extra(reasoning_effort: Option<&str>, kwargs: Option<&Map<String, Value>>) -> Map<String, Value> {
    let mut extra = kwargs.cloned().unwrap_or_default();
    if let Some(r) = reasoning_effort {
        extra.insert("reasoning_effort".into(), r.into());
    }
    extra
}

fn check_unsupported(req: &ChatCompletionRequest) -> ApiResult<()> {
    if req.chat_template.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::not_supported(
            "chat_template",
            "a chat template in the request is not accepted: chats are rendered with the model's template or the deployed chat-template plugin",
        ));
    }
    for (field, instead) in [("functions", "tools"), ("function_call", "tool_choice")] {
        let given = if field == "functions" { &req.functions } else { &req.function_call };
        if given.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::not_supported(
                field,
                format!("'{field}' (deprecated function calling) is not supported: send '{instead}' instead"),
            ));
        }
    }
    match &req.tool_choice {
        None => {}
        Some(Value::String(s)) if s == "auto" || s == "none" => {}
        // Forced tool calls are served by constrained decoding (see tool_choice.rs).
        Some(Value::String(s)) if s == "required" => {}
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {}
        Some(_) => return Err(ApiError::invalid_param(
            "tool_choice",
            "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )),
    }
    if let Some(rf) = &req.response_format {
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            // Enforced by the engine's JSON-object constrained sampling (see the handler).
            Some("json_object") => {}
            // Compiled (and refused if invalid) by the handler.
            Some("json_schema") => {}
            _ => {
                return Err(ApiError::invalid_param(
                    "response_format",
                    "response_format.type must be 'text', 'json_object' or 'json_schema'",
                ))
            }
        }
    }
    if req.top_logprobs.is_some_and(|k| k > 0) && req.logprobs != Some(true) {
        return Err(ApiError::invalid_param("top_logprobs", "'top_logprobs' requires 'logprobs' to be true"));
    }
    Ok(())
}

pub async fn handler(
    State(state): State<AppState>,
    caller: CallerExt,
    OpenAiJson(req): OpenAiJson<ChatCompletionRequest>,
) -> ApiResult<Response> {
    let (gate, opts) = Gate::open(&state, &caller, "/v1/chat/completions", req.model.as_deref(), || {
        check_unsupported(&req)?;
        prompt_options(req.continue_final_message, req.add_generation_prompt, req.add_special_tokens)
    })?;
    // A prompt the request truncates may be as long as it likes; any other must fit the context.
    let opts = PromptOptions {
        max_prompt_tokens: req.sampling.truncate_prompt_tokens.is_none().then(|| state.engine.max_model_len()),
        ..opts
    };
    let messages = normalize_messages(req.messages)?;
    let tools = match (&req.tools, req.tool_choice.as_ref().and_then(Value::as_str)) {
        (Some(t), _) if t.is_empty() => None,
        (Some(_), Some("none")) => None,
        (Some(t), _) => {
            validate_tools(t)?;
            Some(t.clone())
        }
        (None, _) => None,
    };
    let input = ChatTemplateInput {
        messages,
        tools,
        add_generation_prompt: opts.add_generation_prompt,
        extra: template_extra(req.reasoning_effort.as_deref(), req.chat_template_kwargs.as_ref()),
    };
    let (_, prompt_ids) = render_chat_off_runtime(&state, input, opts).await?;
    let max_tokens =
        req.max_completion_tokens.or(req.max_tokens).map_or(usize::MAX, |m| m.min(usize::MAX as u64) as usize);
    let mut ereq = req.sampling.to_engine_request(max_tokens).map_err(|e| {
        if e.param.as_deref() == Some("max_tokens") && req.max_completion_tokens.is_some() {
            e.with_param("max_completion_tokens")
        } else {
            e
        }
    })?;
    ereq.prompt_ids = prompt_ids;
    req.sampling.truncate_prompt(&mut ereq.prompt_ids, state.engine.max_model_len());
    let whitespace = super::structured::json_whitespace(req.sampling.structured_outputs.as_ref())?;
    match req.response_format.as_ref().and_then(|rf| rf.get("type")).and_then(Value::as_str) {
        Some("json_object") => ereq.constraint = Some(ConstraintSpec::JsonObject { whitespace }),
        Some("json_schema") => {
            ereq.constraint = Some(super::structured::response_format_schema(
                req.response_format.as_ref().expect("checked"),
                whitespace,
            )?)
        }
        _ => {}
    }
    if let Some(c) = super::structured::from_sampling_fields(&req.sampling)? {
        ereq.constraint = Some(c);
    }
    let forced = forced_constraint(req.tool_choice.as_ref(), req.tools.as_deref(), whitespace)?;
    let forced_tool = forced.is_some();
    if forced.is_some() {
        ereq.constraint = forced;
    }
    // Reasoning / tool-call plugins (a forced tool call is already structured output).
    let parse_tools = req
        .tools
        .as_deref()
        .filter(|t| !t.is_empty() && req.tool_choice.as_ref().and_then(Value::as_str) != Some("none"));
    let parsers = match (&state.plugins, forced_tool) {
        (Some(reg), false) => ChatParsers::select(
            reg,
            &state.served_model_name,
            gate.tenant(),
            parse_tools,
            req.chat_template_kwargs.as_ref(),
        ),
        _ => None,
    };
    if parsers.as_ref().is_some_and(ChatParsers::needs_special_tokens) {
        ereq.skip_special_tokens = false;
    }
    let want_logprobs = req.logprobs == Some(true);
    ereq.logprobs = want_logprobs.then(|| req.top_logprobs.unwrap_or(0) as usize);
    let vllm_prompt_k = ereq.prompt_logprobs;
    let prompt_ids = req.sampling.returns_token_ids().then(|| ereq.prompt_ids.clone());
    let names = req.sampling.token_names();
    let mut gen = gate
        .submit(vec![ereq], |e| match e.code {
            Some("context_length_exceeded") => e.with_param("messages"),
            _ => e,
        })
        .await?;
    let rate_headers = gen.rate_headers();

    let id = format!("chatcmpl-{:032x}", rand::random::<u128>());
    gen.set_request_id(&id);
    let created = unix_now();
    let model = state.served_model_name.clone();
    if req.sampling.is_stream() {
        let fmt = ChatChunks {
            id,
            created,
            model,
            m: state.model.clone(),
            logprobs: want_logprobs,
            names,
            forced_tool,
            forced: Vec::new(),
            parsers,
            streams: Vec::new(),
            error: None,
        };
        let token_ids = prompt_ids.map(|p| StreamTokenIds::new(vec![p], 1, true, true));
        let mut resp = stream_response(gen, fmt, req.sampling.stream_settings(token_ids));
        tenancy::add_headers(&mut resp, &rate_headers);
        return Ok(resp);
    }
    let (choices, usage) = collect(gen).await?;
    // vLLM puts the (one) prompt's logprobs beside the choices.
    let prompt_logprobs = match (vllm_prompt_k, choices.first().and_then(|c| c.prompt_logprobs.as_deref())) {
        (Some(k), Some(scored)) => Some(vllm_prompt_logprobs(&state.model.tokenizer, scored, k)),
        _ => None,
    };
    // The parser plugins' messages, on the plugin pool (guest code never runs on an async worker).
    let parsed: Vec<Option<(Value, bool)>> = match &parsers {
        Some(p) => {
            let (p, texts) = (p.clone(), choices.iter().map(|c| c.text.clone()).collect::<Vec<_>>());
            let messages =
                state.plugin_calls.run(move || texts.iter().map(|t| p.message(t)).collect::<Result<Vec<_>, _>>());
            messages.await?.map_err(|e| ApiError::from(&e))?.into_iter().map(Some).collect()
        }
        None => vec![None; choices.len()],
    };
    let tok = &state.model.tokenizer;
    let choices: Vec<Value> = choices
        .into_iter()
        .zip(parsed)
        .enumerate()
        .map(|(i, (c, parsed))| -> ApiResult<Value> {
            let logprobs = if want_logprobs {
                json!({"content": c.logprobs.iter().map(|l| chat_entry(tok, names, l)).collect::<Vec<_>>()})
            } else {
                Value::Null
            };
            let forced_call = forced_tool.then(|| tool_call_json(&c.text, 0)).flatten();
            let (message, finish_reason) = match (forced_call, parsed) {
                (Some(call), _) => {
                    (json!({"role": "assistant", "content": null, "tool_calls": [call]}), Some("tool_calls"))
                }
                (None, Some((msg, called))) => {
                    (msg, if called { Some("tool_calls") } else { c.finish_reason.map(|r| r.as_str()) })
                }
                (None, None) => (assistant_message(c.text), c.finish_reason.map(|r| r.as_str())),
            };
            let mut choice = json!({
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            });
            if prompt_ids.is_some() {
                choice["token_ids"] = json!(c.tokens);
            }
            Ok(choice)
        })
        .collect::<ApiResult<_>>()?;
    let mut body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage.to_json(),
    });
    if let Some(p) = prompt_logprobs {
        body["prompt_logprobs"] = p;
    }
    if let Some(ids) = prompt_ids {
        body["prompt_token_ids"] = json!(ids);
    }
    let mut resp = axum::Json(body).into_response();
    tenancy::add_headers(&mut resp, &rate_headers);
    Ok(resp)
}

/// The assistant message of a finished choice when no parser plugin serves the model
/// (with plugins: `ChatParsers::message`).
fn assistant_message(text: String) -> Value {
    json!({"role": "assistant", "content": text})
}

struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    m: Arc<LoadedModel>,
    logprobs: bool,
    names: TokenNames,
    /// A forced tool call is streamed as `tool_calls` deltas (id and name, then the arguments'
    /// text), one stream per choice.
    forced_tool: bool,
    forced: Vec<ForcedCallStream>,
    /// Reasoning / tool-call plugins, with one stream session per choice.
    parsers: Option<ChatParsers>,
    streams: Vec<Option<StreamParsers>>,
    error: Option<ApiError>,
}

impl ChatChunks {
    /// Feeds a choice's text delta through its plugin sessions: the delta to send, or None
    /// (nothing yet, or a plugin failed: `error` is set and the stream ends).
    fn parse(&mut self, choice: usize, text: &str, token: Option<u32>, last: bool) -> Option<Value> {
        let p = self.parsers.as_ref()?;
        if self.streams.len() <= choice {
            self.streams.resize_with(choice + 1, || None);
        }
        if self.streams[choice].is_none() {
            match p.stream() {
                Ok(s) => self.streams[choice] = Some(s),
                Err(e) => {
                    self.error = Some(ApiError::from(&e));
                    return None;
                }
            }
        }
        let s = self.streams[choice].as_mut()?;
        match s.delta(text, token.as_slice(), last) {
            Ok(d) => d,
            Err(e) => {
                self.error = Some(ApiError::from(&e));
                None
            }
        }
    }
}

impl ChatChunks {
    /// A token's chunk `logprobs`: its entry when the request asked for them, else null.
    fn token_logprobs(&self, logprob: Option<&TokenLogprob>) -> Value {
        match logprob {
            Some(l) if self.logprobs => json!({"content": [chat_entry(&self.m.tokenizer, self.names, l)]}),
            _ => Value::Null,
        }
    }

    fn chunk(&self, choice: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": [choice]})
    }
}

impl ChunkFormatter for ChatChunks {
    fn start(&mut self, choices: usize) -> Vec<Value> {
        (0..choices)
            .map(|i| {
                self.chunk(json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
            })
            .collect()
    }

    fn token(&mut self, ev: &GenEvent) -> Option<Value> {
        let GenEvent::Token { choice, text, logprob, .. } = ev else { return None };
        if self.forced_tool {
            if self.forced.len() <= *choice {
                self.forced.resize_with(choice + 1, ForcedCallStream::default);
            }
            let call = self.forced[*choice].push(text);
            let lp = self.token_logprobs(logprob.as_ref());
            if call.is_none() && lp.is_null() {
                return None;
            }
            let delta = call.map_or_else(|| json!({}), |c| json!({"tool_calls": [c]}));
            return Some(self.chunk(json!({"index": choice, "delta": delta, "logprobs": lp, "finish_reason": null})));
        }
        if self.parsers.is_some() {
            let GenEvent::Token { choice, token, text, logprob } = ev else { return None };
            let lp = self.token_logprobs(logprob.as_ref());
            let delta = self.parse(*choice, text, Some(*token), false);
            if delta.is_none() && lp.is_null() {
                return None;
            }
            return Some(self.chunk(
                json!({"index": choice, "delta": delta.unwrap_or(json!({})), "logprobs": lp, "finish_reason": null}),
            ));
        }
        let lp = self.token_logprobs(logprob.as_ref());
        if text.is_empty() && lp.is_null() {
            return None;
        }
        Some(self.chunk(json!({"index": choice, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})))
    }

    fn finish(&mut self, ev: &GenEvent) -> Vec<Value> {
        let GenEvent::Finished { choice, reason, text } = ev else { return vec![] };
        if self.forced_tool {
            let mut call = self.forced.get_mut(*choice).map(std::mem::take).unwrap_or_default();
            let last = call.push(text);
            if !call.started() {
                // Cut off before the call began: the text as it is, as without streaming.
                return vec![self.chunk(json!({"index": choice, "delta": {"content": call.into_text()}, "logprobs": null, "finish_reason": reason.as_str()}))];
            }
            // A call cut off inside its arguments keeps the engine's reason (`length`).
            let reason = if call.complete() { "tool_calls" } else { reason.as_str() };
            let mut out: Vec<Value> = last
                .map(|c| {
                    self.chunk(
                        json!({"index": choice, "delta": {"tool_calls": [c]}, "logprobs": null, "finish_reason": null}),
                    )
                })
                .into_iter()
                .collect();
            out.push(self.chunk(json!({"index": choice, "delta": {}, "logprobs": null, "finish_reason": reason})));
            return out;
        }
        if self.parsers.is_some() {
            let delta = self.parse(*choice, text, None, true);
            if self.error.is_some() {
                return vec![];
            }
            let called = self.streams.get(*choice).and_then(Option::as_ref).is_some_and(StreamParsers::called_tools);
            let mut out = Vec::new();
            if let Some(d) = delta {
                out.push(self.chunk(json!({"index": choice, "delta": d, "logprobs": null, "finish_reason": null})));
            }
            // The choice's plugin sessions end here (their instances go back to the pool).
            if let Some(s) = self.streams.get_mut(*choice) {
                *s = None;
            }
            let reason = if called { "tool_calls" } else { reason.as_str() };
            out.push(self.chunk(json!({"index": choice, "delta": {}, "logprobs": null, "finish_reason": reason})));
            return out;
        }
        let delta = if text.is_empty() { json!({}) } else { json!({"content": text}) };
        vec![self.chunk(json!({"index": choice, "delta": delta, "logprobs": null, "finish_reason": reason.as_str()}))]
    }

    fn take_error(&mut self) -> Option<ApiError> {
        self.error.take()
    }

    fn uses_plugins(&self) -> bool {
        self.parsers.is_some()
    }

    fn usage(&mut self, usage: &Usage) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": [], "usage": usage.to_json()})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_template::jinja::fixtures::{reference, template_source};
    use crate::chat_template::jinja::JinjaChatTemplate;
    use crate::chat_template::{ChatTemplate, ChatTemplateInput};

    /// A conversation as an OpenAI client sends it back: a tool-calling assistant turn with null
    /// content and its arguments as a JSON string (what the API returned).
    fn as_sent_by_a_client(messages: &[Value]) -> Vec<Value> {
        let mut messages = messages.to_vec();
        for m in &mut messages {
            let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) else { continue };
            for c in calls.iter_mut() {
                let args = c["function"]["arguments"].clone();
                c["function"]["arguments"] = Value::String(serde_json::to_string(&args).unwrap());
            }
            if m["content"] == "" {
                m["content"] = Value::Null;
            }
        }
        messages
    }

    /// Every real template's tool-call conversation, sent the way a client sends it, renders to
    /// what transformers renders for the decoded form (tests/reference/templates/expected.json):
    /// without the decoding, `| tojson` templates would quote the arguments twice.
    #[test]
    fn a_clients_tool_call_turns_render_as_transformers_renders_decoded_arguments() {
        let data = reference("templates/expected.json");
        let (mut same, mut null_content, mut failures) = (0, 0, Vec::new());
        for case in data["cases"].as_array().unwrap() {
            let messages = case["messages"].as_array().unwrap();
            let Some(want) = case["prompt"].as_str() else { continue };
            if !messages.iter().any(|m| m.get("tool_calls").is_some()) {
                continue;
            }
            let name = case["template"].as_str().unwrap();
            let src = template_source(name);
            let sent = as_sent_by_a_client(messages);
            assert!(sent
                .iter()
                .any(|m| m.get("tool_calls").is_some_and(|c| c[0]["function"]["arguments"].is_string())));
            null_content += sent.iter().filter(|m| m.get("content") == Some(&Value::Null)).count();
            let t = JinjaChatTemplate::new(&src, case["bos_token"].as_str(), case["eos_token"].as_str()).unwrap();
            let input = ChatTemplateInput {
                messages: normalize_messages(sent).unwrap(),
                tools: case["tools"].as_array().cloned(),
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                extra: case["kwargs"].as_object().cloned().unwrap_or_default(),
            };
            match t.render(&input) {
                Ok(got) if got == want => same += 1,
                got => failures.push(format!("{name}/{}: got {got:?}\nwant {want:?}", case["conversation"])),
            }
        }
        assert!(failures.is_empty(), "{} differ:\n{}", failures.len(), failures.join("\n"));
        assert!(same >= 40 && null_content > 0, "{same} rendered, {null_content} null contents");
    }

    #[test]
    fn text_parts_of_every_text_kind_are_joined() {
        let m = normalize_messages(vec![
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}),
            json!({"role": "assistant", "content": [{"type": "output_text", "text": "c"}, {"type": "refusal", "refusal": "d"}]}),
        ])
        .unwrap();
        assert_eq!((m[0]["content"].as_str(), m[1]["content"].as_str()), (Some("a\nb"), Some("c\nd")));
        let err = |part: Value| normalize_messages(vec![json!({"role": "user", "content": [part]})]).unwrap_err();
        let e = err(json!({"type": "image_url", "image_url": {"url": "x"}}));
        assert_eq!((e.param.as_deref(), e.code), (Some("messages[0].content[0]"), Some("unsupported_parameter")));
        for bad in [json!({"type": "refusal", "text": "d"}), json!({"text": "no type"}), json!({"type": "text"})] {
            assert_eq!(err(bad.clone()).param.as_deref(), Some("messages[0].content[0]"), "{bad}");
        }
    }

    #[test]
    fn tool_call_arguments_are_decoded_and_bad_ones_name_their_place() {
        let call = |args: Value| json!([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": args}}]}]);
        let args_of = |args: Value| {
            let m = normalize_messages(call(args).as_array().unwrap().clone()).unwrap();
            assert_eq!(m[1]["content"], "");
            m[1]["tool_calls"][0]["function"]["arguments"].clone()
        };
        assert_eq!(args_of(json!("{\"city\": \"Paris\", \"n\": [1, 2]}")), json!({"city": "Paris", "n": [1, 2]}));
        assert_eq!(args_of(json!({"city": "Paris"})), json!({"city": "Paris"}));
        assert_eq!(args_of(json!("")), json!({}));
        assert_eq!(args_of(Value::Null), json!({}));
        let err = |messages: Value| normalize_messages(messages.as_array().unwrap().clone()).unwrap_err();
        let e = err(call(json!("{oops")));
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("messages[1].tool_calls[0].function.arguments"));
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        assert_eq!(err(call(json!(5))).param.as_deref(), Some("messages[1].tool_calls[0].function.arguments"));
        let e = err(json!([{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]));
        assert_eq!(e.param.as_deref(), Some("messages[0].tool_calls[0]"));
        let e = err(json!([{"role": "assistant", "tool_calls": {"id": "1"}}]));
        assert_eq!(e.param.as_deref(), Some("messages[0].tool_calls"));
        // A null tool_calls is no calls.
        assert!(normalize_messages(vec![json!({"role": "assistant", "content": "x", "tool_calls": null})]).is_ok());
    }
}
