//! `POST /v1/embeddings`: the texts of one request run as batches of the model (as many rows as
//! its `max_batch_size`, the batches concurrently), each row's vector is one embedding;
//! `dimensions` cuts a Matryoshka model's vectors and renormalises them; `encoding_format`
//! `base64` sends the little-endian FP32 bytes. `usage` counts the prompt tokens from the
//! model's token-count output (zero when it has none).
use std::{fmt::Write, sync::Arc};

use axum::{
    body::Body,
    extract::State,
    http::{HeaderMap, header},
    response::{IntoResponse, Response},
};
use base64::Engine as _;
use bytes::Bytes;
use serde::Deserialize;

use super::{
    ApiError, ApiResult, AppState, body_json, model_roles,
    roles::{self, Operation, Roles},
};
use crate::{
    frontend::http_common::HttpState,
    request::{InferRequest, InputTensor, RequestedOutput},
    tensor::{DataType, Tensor, push_bytes_element},
};

/// Most inputs in one request (OpenAI's own limit).
const MAX_INPUTS: usize = 2048;

#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<i64>),
    ManyTokens(Vec<Vec<i64>>),
    Other(serde::de::IgnoredAny),
}

/// What one request embeds: texts, or token arrays.
enum Prompts {
    Texts(Vec<String>),
    Tokens(Vec<Vec<i64>>),
}

impl Prompts {
    fn len(&self) -> usize {
        match self {
            Prompts::Texts(t) => t.len(),
            Prompts::Tokens(t) => t.len(),
        }
    }
}

#[derive(Deserialize)]
struct EmbeddingsRequest {
    #[serde(default)]
    model: String,
    input: Option<Input>,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<i64>,
}

pub async fn embeddings(State(s): AppState, headers: HeaderMap, body: Body) -> Response {
    match answer(&s, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn answer(s: &HttpState, headers: &HeaderMap, body: Body) -> ApiResult<Response> {
    let req: EmbeddingsRequest = body_json(s, headers, body).await?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad(
                format!("encoding_format '{other}' is not supported: use 'float' or 'base64'"),
                "encoding_format",
            ));
        }
    };
    let prompts = match req.input {
        None => return Err(ApiError::bad("'input' is a required property", "input")),
        Some(Input::One(t)) => Prompts::Texts(vec![t]),
        Some(Input::Many(t)) => Prompts::Texts(t),
        Some(Input::Tokens(t)) => Prompts::Tokens(vec![t]),
        Some(Input::ManyTokens(t)) => Prompts::Tokens(t),
        Some(Input::Other(_)) => {
            return Err(ApiError::bad(
                "'input' must be a string, a list of strings, a token array or a list of token arrays",
                "input",
            ));
        }
    };
    if prompts.len() == 0 {
        return Err(ApiError::bad("'input' must hold at least one text", "input"));
    }
    if prompts.len() > MAX_INPUTS {
        return Err(ApiError::bad(format!("'input' holds {} inputs, more than {MAX_INPUTS}", prompts.len()), "input"));
    }
    let r = model_roles(s, &req.model, Operation::Embeddings)?;
    let batches = match &prompts {
        Prompts::Texts(texts) => batches(&req.model, &r, texts)?,
        Prompts::Tokens(arrays) => token_batches(&req.model, &r, arrays)?,
    };
    let runs = batches.into_iter().map(|(rows, request)| {
        let engine = Arc::clone(&s.engine);
        async move { engine.infer(request).await.map(|resp| (rows, resp.outputs)) }
    });
    let results = futures_util::future::try_join_all(runs).await?;
    let mut vectors: Vec<Vec<f32>> = Vec::with_capacity(prompts.len());
    let mut prompt_tokens = 0u64;
    for (rows, outputs) in results {
        let out = find(&outputs, &r.output)?;
        let values = roles::floats(out)?;
        if rows == 0 || values.len() % rows != 0 || values.is_empty() {
            return Err(ApiError::from(crate::error::Error::internal(format!(
                "model '{}' made {} values in '{}' for {rows} texts",
                req.model,
                values.len(),
                r.output
            ))));
        }
        let per = values.len() / rows;
        vectors.extend(values.chunks_exact(per).map(<[f32]>::to_vec));
        if let (Some(count), Prompts::Texts(_)) = (&r.prompt_tokens, &prompts) {
            prompt_tokens += find(&outputs, count).map(roles::int_sum).unwrap_or(0);
        }
    }
    if let Prompts::Tokens(arrays) = &prompts {
        prompt_tokens = arrays.iter().map(|a| a.len() as u64).sum();
    }
    if let Some(d) = req.dimensions {
        let width = vectors.first().map_or(0, Vec::len);
        if d <= 0 || d as usize > width {
            return Err(ApiError::bad(format!("dimensions must be between 1 and {width}, got {d}"), "dimensions"));
        }
        if (d as usize) < width {
            if !r.truncatable {
                return Err(ApiError::bad(
                    format!(
                        "model '{}' makes {width}-dimensional embeddings and cannot shorten them (its config does not set openai_truncatable_dimensions)",
                        req.model
                    ),
                    "dimensions",
                ));
            }
            for v in &mut vectors {
                v.truncate(d as usize);
                let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
                if norm > 0.0 {
                    v.iter_mut().for_each(|x| *x /= norm);
                }
            }
        }
    }
    s.engine.record_tokens(&req.model, prompt_tokens, 0);
    let body = encode(&req.model, &vectors, base64, prompt_tokens);
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

fn find<'a>(outputs: &'a [Tensor], name: &str) -> ApiResult<&'a Tensor> {
    outputs
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| ApiError::from(crate::error::Error::internal(format!("the model made no output '{name}'"))))
}

/// The engine requests for `texts`: as many rows each as the model batches (one request of all
/// of them for a model that does not batch but takes a variable count of texts).
fn batches(model: &str, r: &Roles, texts: &[String]) -> ApiResult<Vec<(usize, InferRequest)>> {
    let text_input = r.text_input.as_ref().ok_or_else(|| {
        ApiError::bad(format!("model '{model}' takes token arrays, not text: send 'input' as token ids"), "input")
    })?;
    let batching = r.max_batch_size > 0;
    let variable = text_input.dims.iter().any(|d| *d < 0);
    let per_request = if batching {
        r.max_batch_size
    } else if variable {
        texts.len()
    } else {
        1
    };
    let mut outputs = vec![RequestedOutput { name: r.output.clone(), ..Default::default() }];
    if let Some(c) = &r.prompt_tokens {
        outputs.push(RequestedOutput { name: c.clone(), ..Default::default() });
    }
    texts
        .chunks(per_request)
        .map(|chunk| {
            let mut data = Vec::with_capacity(chunk.iter().map(|t| t.len() + 4).sum());
            for t in chunk {
                push_bytes_element(&mut data, t.as_bytes());
            }
            let shape = if batching {
                roles::shape_for(text_input, true, chunk.len(), 1)
            } else {
                roles::shape_for(text_input, false, 1, chunk.len())
            }
            .map_err(|e| ApiError::bad(e.message(), "input"))?;
            let input = InputTensor::host(text_input.name.clone(), DataType::Bytes, shape, Bytes::from(data));
            Ok((chunk.len(), request(model, vec![input], outputs.clone())))
        })
        .collect()
}

/// The engine requests for token arrays, padded per request (see `tokens`).
fn token_batches(model: &str, r: &Roles, arrays: &[Vec<i64>]) -> ApiResult<Vec<(usize, InferRequest)>> {
    let tokens = r.tokens.as_ref().ok_or_else(|| {
        ApiError::bad(
            format!("model '{model}' takes text, not token arrays (its config names no openai_token_input)"),
            "input",
        )
    })?;
    let per_request = tokens.rows_per_request(r.max_batch_size, arrays.len());
    let outputs = vec![RequestedOutput { name: r.output.clone(), ..Default::default() }];
    arrays
        .chunks(per_request)
        .enumerate()
        .map(|(k, chunk)| {
            let inputs =
                tokens.inputs(chunk, k * per_request, r.max_batch_size > 0).map_err(|e| ApiError::bad(e, "input"))?;
            Ok((chunk.len(), request(model, inputs, outputs.clone())))
        })
        .collect()
}

fn request(model: &str, inputs: Vec<InputTensor>, outputs: Vec<RequestedOutput>) -> InferRequest {
    InferRequest { model_name: model.to_string(), inputs, outputs, ..Default::default() }
}

/// The response body, written directly (a float as its shortest FP32 text, as OpenAI's).
fn encode(model: &str, vectors: &[Vec<f32>], base64: bool, prompt_tokens: u64) -> String {
    let width = vectors.first().map_or(0, Vec::len);
    let mut out = String::with_capacity(64 + vectors.len() * (48 + width * if base64 { 6 } else { 12 }));
    out.push_str("{\"object\":\"list\",\"data\":[");
    let mut ryu = ryu::Buffer::new();
    for (i, v) in vectors.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{{\"object\":\"embedding\",\"index\":{i},\"embedding\":");
        if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            out.push('"');
            out.push_str(&base64::engine::general_purpose::STANDARD.encode(bytes));
            out.push('"');
        } else {
            out.push('[');
            for (j, x) in v.iter().enumerate() {
                if j > 0 {
                    out.push(',');
                }
                if x.is_finite() { out.push_str(ryu.format_finite(*x)) } else { out.push_str("null") }
            }
            out.push(']');
        }
        out.push('}');
    }
    let model = serde_json::Value::String(model.to_string());
    let _ = write!(
        out,
        "],\"model\":{model},\"usage\":{{\"prompt_tokens\":{prompt_tokens},\"total_tokens\":{prompt_tokens}}}}}"
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_openais_json() {
        let body = encode("m\"x", &[vec![0.5, -1.25], vec![f32::NAN, 3.0]], false, 7);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["data"][0]["embedding"], serde_json::json!([0.5, -1.25]));
        assert_eq!(v["data"][1]["embedding"][0], serde_json::Value::Null);
        assert_eq!(v["data"][1]["index"], 1);
        assert_eq!(v["model"], "m\"x");
        assert_eq!(v["usage"]["prompt_tokens"], 7);
        let b = encode("m", &[vec![1.0]], true, 0);
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        let raw =
            base64::engine::general_purpose::STANDARD.decode(v["data"][0]["embedding"].as_str().unwrap()).unwrap();
        assert_eq!(raw, 1.0f32.to_le_bytes());
    }
}
