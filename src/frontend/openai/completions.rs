//! `POST /v1/completions` and `POST /v1/chat/completions` over a model that takes text and
//! makes text (`roles`). Chat messages become the prompt through the model's chat template.
//! The sampling fields reach the model as the inputs Triton's OpenAI front-end fills where the
//! model has them (`max_tokens`, `temperature`, `top_p`, `seed`, `stop_words`, `stream`, ...),
//! else as request parameters of those names (`stop`: one string, or a JSON list). A decoupled
//! model's responses are the completion's pieces: streamed (`stream: true`) as OpenAI's chunks,
//! else joined. `stop` sequences the model does not take as an input are applied here. `n`
//! runs that many requests. Other scalar fields of the body (`top_k`, ...) are request parameters.
//! A client that goes away cancels the requests.
use std::{collections::VecDeque, convert::Infallible};

use axum::{
    body::{Body, Bytes},
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{
    ApiError, ApiResult, AppState, body_json, model_roles, now,
    roles::{self, Operation, Roles, Scalar},
    template::{self, Message},
};
use crate::{
    engine::ResponseStream,
    error::Error,
    frontend::{http_common::HttpState, platform::random_u64},
    request::{InferRequest, InputTensor, ParamValue, Parameters, StreamItem},
    tensor::{DataType, bytes_elements, push_bytes_element},
};

/// Most choices (`n`) one request may ask for.
const MAX_N: u64 = 16;
/// Most `stop` sequences, and the longest.
const MAX_STOPS: usize = 4;
const MAX_STOP_LEN: usize = 1024;
/// Longest completion held for a client that does not stream.
const MAX_HELD: usize = 16 << 20;
/// `max_tokens` when the model needs it and the request does not say (Triton's default).
const DEFAULT_MAX_TOKENS: i128 = 16;

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// What both routes take besides the prompt.
#[derive(Deserialize, Default)]
struct Sampling {
    #[serde(default)]
    model: String,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    frequency_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    seed: Option<i64>,
    stop: Option<OneOrMany>,
    n: Option<u64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// Other fields (e.g. `top_k`): request parameters when they are scalars.
    #[serde(flatten)]
    extra: serde_json::Map<String, Value>,
}

/// Fields that are not passed on as request parameters: the API's own, and the names the
/// engine reserves (KServe's scheduling parameters; Triton's `triton_` prefix).
const NOT_PASSED: &[&str] = &[
    "prompt",
    "messages",
    "user",
    "logprobs",
    "top_logprobs",
    "echo",
    "logit_bias",
    "suffix",
    "best_of",
    "tools",
    "tool_choice",
    "response_format",
    "priority",
    "timeout",
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "binary_data_output",
    "headers",
];

/// Fields ferry does not serve yet, refused (400) unless they ask for nothing.
fn unsupported(extra: &serde_json::Map<String, Value>) -> Option<&'static str> {
    let asks = |k: &str| match extra.get(k) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(Value::String(s)) => !(s.is_empty() || k == "tool_choice" && s == "none"),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Number(n)) => {
            !(k == "best_of" && n.as_u64() == Some(1) || k == "logprobs" && n.as_u64() == Some(0))
        }
        Some(Value::Object(o)) => !(k == "response_format" && o.get("type").and_then(Value::as_str) == Some("text")),
    };
    ["echo", "logprobs", "top_logprobs", "best_of", "suffix", "tools", "tool_choice", "response_format", "logit_bias"]
        .into_iter()
        .find(|k| asks(k))
}
/// Most other fields passed on.
const MAX_EXTRA: usize = 64;

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: Option<Value>,
    #[serde(flatten)]
    sampling: Sampling,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Option<Vec<ChatMessage>>,
    #[serde(flatten)]
    sampling: Sampling,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

pub async fn completions(State(s): AppState, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        let req: CompletionRequest = body_json(&s, &headers, body).await?;
        let prompts = match req.prompt {
            Some(Value::String(p)) => vec![p],
            Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_string) => {
                items.into_iter().filter_map(|v| v.as_str().map(str::to_string)).collect()
            }
            Some(Value::Array(_)) => {
                return Err(ApiError::bad(
                    "'prompt' must be a string or a list of strings (token arrays are not supported)",
                    "prompt",
                ));
            }
            _ => return Err(ApiError::bad("'prompt' is a required property", "prompt")),
        };
        let r = model_roles(&s, &req.sampling.model, Operation::Completions)?;
        run(&s, &r, Kind::Completion, prompts, req.sampling).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn chat_completions(State(s): AppState, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        let req: ChatRequest = body_json(&s, &headers, body).await?;
        let messages = match req.messages {
            Some(m) if !m.is_empty() => m,
            _ => return Err(ApiError::bad("'messages' must hold at least one message", "messages")),
        };
        let messages = messages.into_iter().map(message).collect::<ApiResult<Vec<Message>>>()?;
        let r = model_roles(&s, &req.sampling.model, Operation::Completions)?;
        let tokens = (r.bos_token.as_str(), r.eos_token.as_str());
        let (template, limit) = (r.chat_template.clone(), s.max_input_size);
        let (bos, eos) = (tokens.0.to_string(), tokens.1.to_string());
        // Off the async workers: a long conversation or a slow template must not hold them.
        let rendered =
            tokio::task::spawn_blocking(move || template::render(template.as_deref(), &messages, (&bos, &eos), limit))
                .await
                .map_err(|e| ApiError::from(Error::internal(format!("the chat template did not finish: {e}"))))?;
        let prompt = match rendered {
            Ok(p) => p,
            Err(template::Failure::Messages(m)) => return Err(ApiError::bad(m, "messages")),
            Err(template::Failure::Template(m)) => return Err(ApiError::from(Error::internal(m))),
        };
        run(&s, &r, Kind::Chat, vec![prompt], req.sampling).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// A chat message's text: a string, or the text parts of a list.
fn message(m: ChatMessage) -> ApiResult<Message> {
    let content = match m.content {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::bad(
                            format!("content parts of type {} are not supported: only text", kind.unwrap_or("(none)")),
                            "messages",
                        ));
                    }
                }
            }
            text
        }
        Some(_) => return Err(ApiError::bad("a message's content must be a string or a list of parts", "messages")),
    };
    Ok(Message { role: m.role, content })
}

/// What one run of the model is asked, checked.
struct Asked {
    max_tokens: Option<u64>,
    stops: Vec<String>,
    n: u64,
}

fn check(sampling: &Sampling) -> ApiResult<Asked> {
    if let Some(field) = unsupported(&sampling.extra) {
        return Err(ApiError::bad(format!("'{field}' is not supported by this server"), field));
    }
    let stops = sampling.stop.as_ref().map(|s| match s {
        OneOrMany::One(s) => vec![s.clone()],
        OneOrMany::Many(v) => v.clone(),
    });
    let stops: Vec<String> = stops.unwrap_or_default().into_iter().filter(|s| !s.is_empty()).collect();
    if stops.len() > MAX_STOPS || stops.iter().any(|s| s.len() > MAX_STOP_LEN) {
        return Err(ApiError::bad(
            format!("'stop' takes at most {MAX_STOPS} sequences of {MAX_STOP_LEN} bytes"),
            "stop",
        ));
    }
    let n = sampling.n.unwrap_or(1);
    if n == 0 || n > MAX_N {
        return Err(ApiError::bad(format!("'n' must be between 1 and {MAX_N}, got {n}"), "n"));
    }
    let range = |v: Option<f64>, lo: f64, hi: f64, name: &'static str| match v {
        Some(x) if !(lo..=hi).contains(&x) => {
            Err(ApiError::bad(format!("'{name}' must be between {lo} and {hi}, got {x}"), name))
        }
        _ => Ok(()),
    };
    range(sampling.temperature, 0.0, 2.0, "temperature")?;
    range(sampling.top_p, 0.0, 1.0, "top_p")?;
    range(sampling.frequency_penalty, -2.0, 2.0, "frequency_penalty")?;
    range(sampling.presence_penalty, -2.0, 2.0, "presence_penalty")?;
    let max_tokens = sampling.max_completion_tokens.or(sampling.max_tokens);
    if max_tokens == Some(0) {
        return Err(ApiError::bad("'max_tokens' must be at least 1", "max_tokens"));
    }
    Ok(Asked { max_tokens, stops, n })
}

/// The engine request for one prompt: the text, the generation inputs the model has, the rest
/// of the sampling fields as request parameters.
fn request(model: &str, r: &Roles, prompt: &str, s: &Sampling, asked: &Asked) -> ApiResult<InferRequest> {
    let batching = r.max_batch_size > 0;
    let mut data = Vec::with_capacity(prompt.len() + 4);
    push_bytes_element(&mut data, prompt.as_bytes());
    let text_input = r.text_input.as_ref().ok_or_else(|| ApiError::bad("the model takes no text", "model"))?;
    let shape = roles::shape_for(text_input, batching, 1, 1).map_err(|e| ApiError::bad(e.message(), "prompt"))?;
    let mut inputs = vec![InputTensor::host(text_input.name.clone(), DataType::Bytes, shape, Bytes::from(data))];
    let mut parameters = Parameters::new();
    let passed = |k: &&String| !NOT_PASSED.contains(&k.as_str()) && !k.starts_with("triton_");
    for (k, v) in s.extra.iter().filter(|(k, _)| passed(k)).take(MAX_EXTRA) {
        let p = match v {
            Value::Bool(b) => ParamValue::Bool(*b),
            Value::String(t) => ParamValue::String(t.clone()),
            Value::Number(n) if n.is_i64() => ParamValue::Int(n.as_i64().unwrap_or_default()),
            Value::Number(n) => ParamValue::Double(n.as_f64().unwrap_or_default()),
            _ => continue,
        };
        parameters.insert(k.clone(), p);
    }
    let max_tokens = asked.max_tokens;
    let float = |v: Option<f64>, default: f64| (Scalar::Number(v.unwrap_or(default)), v.is_some());
    let int = |v: Option<i128>, default: i128| (Scalar::Integer(v.unwrap_or(default)), v.is_some());
    let values = [
        ("max_tokens", int(max_tokens.map(i128::from), DEFAULT_MAX_TOKENS)),
        ("temperature", float(s.temperature, 1.0)),
        ("top_p", float(s.top_p, 1.0)),
        ("frequency_penalty", float(s.frequency_penalty, 0.0)),
        ("presence_penalty", float(s.presence_penalty, 0.0)),
        ("seed", int(s.seed.map(i128::from), 0)),
    ];
    for (name, (value, was_given)) in values {
        match r.extra(name) {
            Some(i) if was_given || !i.optional => {
                inputs.push(roles::scalar_input(i, batching, value).map_err(|e| ApiError::bad(e.message(), name))?)
            }
            Some(_) => {}
            None if was_given => {
                let p = match value {
                    Scalar::Integer(v) => i64::try_from(v).map_or(ParamValue::Uint(v as u64), ParamValue::Int),
                    Scalar::Number(v) => ParamValue::Double(v),
                    _ => continue,
                };
                parameters.insert(name.to_string(), p);
            }
            None => {}
        }
    }
    let bad_input = |e: Error| ApiError::bad(e.message(), "model");
    let flag = |name: &str, value: bool, inputs: &mut Vec<InputTensor>| -> ApiResult<()> {
        if let Some(i) = r.extra(name) {
            inputs.push(roles::scalar_input(i, batching, Scalar::Bool(value)).map_err(bad_input)?);
        }
        Ok(())
    };
    flag("stream", s.stream && r.decoupled, &mut inputs)?;
    flag("return_num_input_tokens", true, &mut inputs)?;
    flag("return_num_output_tokens", true, &mut inputs)?;
    if let Some(i) = r.extra("stop_words") {
        if !asked.stops.is_empty() || !i.optional {
            let mut data = Vec::new();
            asked.stops.iter().for_each(|w| push_bytes_element(&mut data, w.as_bytes()));
            let shape = roles::shape_for(i, batching, 1, asked.stops.len()).map_err(bad_input)?;
            inputs.push(InputTensor::host(i.name.clone(), DataType::Bytes, shape, Bytes::from(data)));
        }
    } else if !asked.stops.is_empty() {
        let stop = if asked.stops.len() == 1 { asked.stops[0].clone() } else { json!(asked.stops).to_string() };
        parameters.insert("stop".into(), ParamValue::String(stop));
    }
    if let Some(i) = r.extra("sampling_parameters") {
        let mut sp = serde_json::Map::new();
        if let Some(m) = max_tokens {
            sp.insert("max_tokens".into(), json!(m));
        }
        let fields = [
            ("temperature", s.temperature),
            ("top_p", s.top_p),
            ("frequency_penalty", s.frequency_penalty),
            ("presence_penalty", s.presence_penalty),
        ];
        for (k, v) in fields {
            if let Some(v) = v {
                sp.insert(k.into(), json!(v));
            }
        }
        if let Some(seed) = s.seed {
            sp.insert("seed".into(), json!(seed));
        }
        if !asked.stops.is_empty() {
            sp.insert("stop".into(), json!(asked.stops));
        }
        inputs.push(roles::scalar_input(i, batching, Scalar::Text(Value::Object(sp).to_string())).map_err(bad_input)?);
    }
    Ok(InferRequest { model_name: model.to_string(), parameters, inputs, ..Default::default() })
}

/// `stop` sequences applied to text as it comes: what may be the start of one is held back.
struct Stops {
    stops: Vec<String>,
    held: String,
}

impl Stops {
    /// The text that is surely before any stop sequence, and whether one was met.
    fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Held back: the longest end of the text that begins a stop sequence.
        let longest = self.stops.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
        let held = &self.held;
        let keep = (1..=longest.min(held.len()))
            .rev()
            .filter(|k| held.is_char_boundary(held.len() - k))
            .find(|k| self.stops.iter().any(|s| s.starts_with(&held[held.len() - k..])))
            .unwrap_or(0);
        let cut = held.len() - keep;
        (self.held.drain(..cut).collect(), false)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// One choice as it is made.
struct Choice {
    stops: Stops,
    completion_tokens: u64,
    counted_tokens: bool,
    prompt_tokens: u64,
    finish: Option<String>,
    done: bool,
    /// Its finish was sent (streams).
    closed: bool,
    /// The end of a UTF-8 character split between two responses.
    partial: Vec<u8>,
}

impl Choice {
    /// A choice; `stop` sequences are applied here unless the model takes them (`stop_words`).
    fn new(asked: &Asked, r: &Roles) -> Choice {
        let stops = if r.extra("stop_words").is_some() { Vec::new() } else { asked.stops.clone() };
        Choice {
            stops: Stops { stops, held: String::new() },
            completion_tokens: 0,
            counted_tokens: false,
            prompt_tokens: 0,
            finish: None,
            done: false,
            closed: false,
            partial: Vec::new(),
        }
    }

    /// `bytes` after what was left over, as text; an incomplete character at the end waits for
    /// the next piece, invalid bytes become U+FFFD.
    fn decode(&mut self, bytes: &[u8]) -> String {
        self.partial.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.partial) {
                Ok(s) => {
                    out.push_str(s);
                    self.partial.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.partial[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: kept for the next piece.
                        None => {
                            self.partial.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.partial.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// The text a response adds to the completion (the model's text output, every element).
    fn absorb(&mut self, r: &Roles, item: &StreamItem) -> Result<String, Error> {
        if self.done {
            return Ok(String::new());
        }
        let mut text = String::new();
        for t in &item.response.outputs {
            if t.name == r.output {
                for e in bytes_elements(&t.data) {
                    let piece = self.decode(e?);
                    text.push_str(&piece);
                }
            } else if Some(&t.name) == r.completion_tokens.as_ref() {
                self.completion_tokens += roles::int_sum(t);
                self.counted_tokens = true;
            } else if Some(&t.name) == r.prompt_tokens.as_ref() {
                self.prompt_tokens = self.prompt_tokens.max(roles::int_sum(t));
            }
        }
        if let Some(ParamValue::String(f)) = item.response.parameters.get("finish_reason") {
            self.finish = Some(f.clone());
        }
        if !self.counted_tokens && !text.is_empty() {
            // Without a token-count output: a response is a token (a token-by-token stream).
            self.completion_tokens += 1;
        }
        let (out, hit) = self.stops.push(&text);
        if hit {
            self.finish = Some("stop".into());
            self.done = true;
        }
        Ok(out)
    }

    /// The held-back text and the finish reason, once the model is done.
    fn finish(&mut self, max_tokens: Option<u64>) -> (String, String) {
        let mut rest = if self.done { String::new() } else { self.stops.flush() };
        if !self.done && !self.partial.is_empty() {
            rest.push('\u{FFFD}');
            self.partial.clear();
        }
        self.done = true;
        let reason = self.finish.clone().unwrap_or_else(|| {
            if max_tokens.is_some_and(|m| self.completion_tokens >= m) { "length".into() } else { "stop".into() }
        });
        (rest, reason)
    }
}

/// The streams of `n` runs of each prompt, in choice order.
async fn start(
    s: &HttpState,
    r: &Roles,
    prompts: &[String],
    sampling: &Sampling,
    asked: &Asked,
) -> ApiResult<Vec<ResponseStream>> {
    let mut streams = Vec::new();
    for p in prompts {
        for _ in 0..asked.n {
            let req = request(&sampling.model, r, p, sampling, asked)?;
            streams.push(s.engine.infer_stream(req).await?);
        }
    }
    Ok(streams)
}

async fn run(s: &HttpState, r: &Roles, kind: Kind, prompts: Vec<String>, sampling: Sampling) -> ApiResult<Response> {
    let asked = check(&sampling)?;
    if prompts.len() as u64 * asked.n > MAX_N {
        return Err(ApiError::bad(format!("prompts times 'n' must be at most {MAX_N}"), "n"));
    }
    let streams = start(s, r, &prompts, &sampling, &asked).await?;
    let id = match kind {
        Kind::Completion => format!("cmpl-{:016x}", random_u64()),
        Kind::Chat => format!("chatcmpl-{:016x}", random_u64()),
    };
    let head =
        Head { id, created: now(), model: sampling.model.clone(), kind, engine: std::sync::Arc::clone(&s.engine) };
    if sampling.stream {
        let usage = sampling.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(stream(head, r.clone(), streams, asked, usage));
    }
    whole(head, r, streams, &asked).await
}

struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// Where the tokens counted are recorded.
    engine: std::sync::Arc<crate::engine::Engine>,
}

impl Head {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({"id": self.id, "object": self.object(chunk), "created": self.created, "model": self.model, "system_fingerprint": null, "choices": choices})
    }

    /// A streamed choice's piece: text (or a chat delta), with its finish reason at the end.
    fn piece(&self, index: usize, text: Option<&str>, role: bool, finish: Option<&str>) -> Value {
        match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        }
    }
}

/// The usage of these choices: (prompt, completion) tokens.
fn tokens(choices: &[Choice]) -> (u64, u64) {
    let prompt: u64 = choices.iter().map(|c| c.prompt_tokens).max().unwrap_or(0);
    let completion: u64 = choices.iter().map(|c| c.completion_tokens).fold(0, u64::saturating_add);
    (prompt, completion)
}

fn usage(choices: &[Choice]) -> Value {
    let (prompt, completion) = tokens(choices);
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt.saturating_add(completion)})
}

/// One choice read to its end: its text, finish reason and counts.
async fn collect(r: &Roles, mut rx: ResponseStream, asked: &Asked) -> ApiResult<(String, String, Choice)> {
    let mut c = Choice::new(asked, r);
    let mut text = String::new();
    while let Some(item) = rx.recv().await {
        text.push_str(&c.absorb(r, &item?)?);
        if text.len() > MAX_HELD {
            return Err(ApiError::from(Error::too_large(format!(
                "the completion is longer than {MAX_HELD} bytes: ask for it with stream: true"
            ))));
        }
        if c.done {
            break;
        }
    }
    let (rest, finish) = c.finish(asked.max_tokens);
    text.push_str(&rest);
    Ok((text, finish, c))
}

/// Every choice whole (read side by side, so that none falls behind), in one JSON answer.
async fn whole(head: Head, r: &Roles, streams: Vec<ResponseStream>, asked: &Asked) -> ApiResult<Response> {
    let done = futures_util::future::try_join_all(streams.into_iter().map(|rx| collect(r, rx, asked))).await?;
    let mut choices: Vec<Choice> = Vec::new();
    let mut bodies = Vec::new();
    for (index, (text, finish, c)) in done.into_iter().enumerate() {
        bodies.push(match head.kind {
            Kind::Completion => json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish}),
            Kind::Chat => json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}),
        });
        choices.push(c);
    }
    let (prompt, completion) = tokens(&choices);
    head.engine.record_tokens(&head.model, prompt, completion);
    let mut body = head.envelope(false, bodies);
    body["usage"] = usage(&choices);
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

/// The choices as OpenAI's server-sent events, ending `data: [DONE]`.
fn stream(head: Head, r: Roles, streams: Vec<ResponseStream>, asked: Asked, include_usage: bool) -> Response {
    let count = streams.len();
    let merged = futures_util::stream::select_all(streams.into_iter().enumerate().map(|(i, rx)| {
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) })
            .map(move |item| (i, item))
            .boxed()
    }));
    let mut pending: VecDeque<Value> = VecDeque::new();
    if head.kind == Kind::Chat {
        pending.extend((0..count).map(|i| head.envelope(true, vec![head.piece(i, Some(""), true, None)])));
    }
    let choices: Vec<Choice> = (0..count).map(|_| Choice::new(&asked, &r)).collect();
    let state =
        Sse { head, r, asked, include_usage, merged: Some(merged), pending, choices, ended: false, done_sent: false };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        let frame = st.next().await?;
        Some((Ok::<_, Infallible>(frame), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|e| ApiError::from(Error::internal(e.to_string())).into_response())
}

type Merged = futures_util::stream::SelectAll<
    futures_util::stream::BoxStream<'static, (usize, crate::error::Result<StreamItem>)>,
>;

struct Sse {
    head: Head,
    r: Roles,
    asked: Asked,
    include_usage: bool,
    merged: Option<Merged>,
    pending: VecDeque<Value>,
    choices: Vec<Choice>,
    ended: bool,
    done_sent: bool,
}

impl Drop for Sse {
    /// What the stream counted, also when its client left early.
    fn drop(&mut self) {
        let (prompt, completion) = tokens(&self.choices);
        self.head.engine.record_tokens(&self.head.model, prompt, completion);
    }
}

impl Sse {
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(v) = self.pending.pop_front() {
                return Some(Bytes::from(format!("data: {v}\n\n")));
            }
            if self.ended {
                if self.done_sent {
                    return None;
                }
                self.done_sent = true;
                return Some(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            let item = match self.merged.as_mut() {
                Some(m) => m.next().await,
                None => None,
            };
            match item {
                Some((i, Ok(item))) => {
                    let last = item.last;
                    match self.choices[i].absorb(&self.r, &item) {
                        Ok(text) if !text.is_empty() => self
                            .pending
                            .push_back(self.head.envelope(true, vec![self.head.piece(i, Some(&text), false, None)])),
                        Ok(_) => {}
                        Err(e) => return Some(self.fail(e)),
                    }
                    if (last || self.choices[i].done) && !self.choices[i].closed {
                        self.close(i);
                    }
                    if self.choices.iter().all(|c| c.closed) {
                        self.merged = None; // the remaining runs, cancelled
                        self.end();
                    }
                }
                Some((_, Err(e))) => return Some(self.fail(e)),
                None => {
                    for i in 0..self.choices.len() {
                        if !self.choices[i].closed {
                            self.close(i);
                        }
                    }
                    self.end();
                }
            }
        }
    }

    /// Choice `i` is over: its held-back text and finish reason.
    fn close(&mut self, i: usize) {
        self.choices[i].closed = true;
        let (rest, finish) = self.choices[i].finish(self.asked.max_tokens);
        let text = (!rest.is_empty()).then_some(rest.as_str());
        let piece = match (self.head.kind, text) {
            (Kind::Chat, None) => self.head.piece(i, None, false, Some(&finish)),
            (_, t) => self.head.piece(i, Some(t.unwrap_or("")), false, Some(&finish)),
        };
        self.pending.push_back(self.head.envelope(true, vec![piece]));
    }

    fn end(&mut self) {
        if self.include_usage {
            let mut v = self.head.envelope(true, Vec::new());
            v["usage"] = usage(&self.choices);
            self.pending.push_back(v);
        }
        self.ended = true;
    }

    /// An error after the stream began: an error event, then the end.
    fn fail(&mut self, e: Error) -> Bytes {
        self.merged = None;
        self.pending.clear();
        self.ended = true;
        self.done_sent = true;
        Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", ApiError::from(e).body()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_sequences_split_across_pieces() {
        let mut s = Stops { stops: vec!["END".into()], held: String::new() };
        assert_eq!(s.push("hello E"), ("hello ".to_string(), false));
        assert_eq!(s.push("N"), (String::new(), false));
        assert_eq!(s.push("D more"), (String::new(), true));
        // Only what may begin a stop sequence is held back, at a character boundary.
        let mut s = Stops { stops: vec!["xyz".into(), "éa".into()], held: String::new() };
        assert_eq!(s.push("aé"), ("a".to_string(), false));
        assert_eq!(s.flush(), "é");
        assert_eq!(s.push("ab"), ("ab".to_string(), false));
        let mut none = Stops { stops: Vec::new(), held: String::new() };
        assert_eq!(none.push("all"), ("all".to_string(), false));
    }
}
