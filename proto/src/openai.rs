//! OpenAI request bodies: parsing and validation of `/v1/chat/completions`, `/v1/completions`
//! and `/v1/responses`, shared by the EPP and the workers so both read a request the same way.
//!
//! Parsing extracts what routing and the simulated engine need (model, stream flags, token
//! budget, cache salt, the prompt) and keeps the whole body for pass-through. Chat messages are
//! normalised here the way vLLM does before it applies a chat template (text content parts
//! joined with `"\n"`, `null` content → `""`, tool-call arguments given as a JSON string parsed
//! into an object), and Responses API input is converted to chat messages, so that
//! [`crate::prompt::PromptRenderer`] only ever sees one message shape.
//!
//! Every error is a client error (HTTP 400) with an OpenAI-shaped JSON body.

use serde_json::{json, Map, Value};

/// Which OpenAI endpoint a request was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiKind {
    ChatCompletions,
    Completions,
    Responses,
}

impl ApiKind {
    /// Maps a request path (`:path`, possibly with a query string) to an API kind.
    pub fn from_path(path: &str) -> Option<ApiKind> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        // Tolerate a trailing slash: proxies and some clients add one.
        let path = path.strip_suffix('/').unwrap_or(path);
        match path {
            "/v1/chat/completions" => Some(ApiKind::ChatCompletions),
            "/v1/completions" => Some(ApiKind::Completions),
            "/v1/responses" => Some(ApiKind::Responses),
            _ => None,
        }
    }

    /// The canonical path of this API.
    pub fn path(self) -> &'static str {
        match self {
            ApiKind::ChatCompletions => "/v1/chat/completions",
            ApiKind::Completions => "/v1/completions",
            ApiKind::Responses => "/v1/responses",
        }
    }
}

/// A parsed, validated OpenAI request.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    pub model: String,
    pub stream: bool,
    /// `stream_options.include_usage`: send a final usage chunk on a stream.
    pub include_usage: bool,
    /// `max_completion_tokens` | `max_tokens` (chat, completions) | `max_output_tokens` (responses).
    pub max_tokens: Option<u32>,
    /// Body `cache_salt` (vLLM) or `nvext.cache_salt` (Dynamo).
    pub cache_salt: Option<String>,
    /// Set by the caller when the model name is a LoRA adapter; parsing leaves it `None`.
    pub lora_name: Option<String>,
    pub input: PromptInput,
    /// The whole parsed body, for pass-through.
    pub body: Value,
}

/// The prompt of a request, before templating and tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Chat messages (normalised, see the module doc), tools and `chat_template_kwargs`.
    Chat {
        messages: Vec<Value>,
        tools: Option<Value>,
        template_kwargs: Option<Value>,
    },
    /// A completions prompt given as text.
    Text(String),
    /// A completions prompt given as token ids.
    TokenIds(Vec<u32>),
}

/// Why a request body was rejected. All are client errors (HTTP 400).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("request body is not valid UTF-8 (invalid byte at offset {valid_up_to})")]
    InvalidUtf8 { valid_up_to: usize },
    #[error("request body is not valid JSON: {message} at line {line} column {column}")]
    InvalidJson {
        message: String,
        line: usize,
        column: usize,
    },
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("missing required field 'model'")]
    MissingModel,
    #[error("missing required field '{field}'")]
    MissingField { field: String },
    #[error("invalid '{field}': {why}")]
    BadField { field: String, why: String },
}

impl RequestError {
    /// The HTTP status to answer with: 400 for every parse error.
    pub fn http_status(&self) -> u16 {
        400
    }

    /// The request field the error is about, if any (OpenAI's `param`).
    pub fn param(&self) -> Option<&str> {
        match self {
            RequestError::MissingModel => Some("model"),
            RequestError::MissingField { field } | RequestError::BadField { field, .. } => {
                Some(field)
            }
            _ => None,
        }
    }

    /// The OpenAI error object for this error.
    pub fn openai_error_json(&self) -> Value {
        openai_error_value(
            self.http_status(),
            &self.to_string(),
            "invalid_request_error",
            self.param(),
        )
    }
}

/// `{"error":{"message","type","param","code"}}` as a JSON value; `code` is the HTTP status
/// (vLLM's convention).
pub fn openai_error_value(
    status: u16,
    message: &str,
    err_type: &str,
    param: Option<&str>,
) -> Value {
    json!({
        "error": {
            "message": message,
            "type": err_type,
            "param": param,
            "code": status,
        }
    })
}

/// `{"error":{"message","type","param","code"}}` serialized, OpenAI's error shape.
pub fn openai_error_body(
    status: u16,
    message: &str,
    err_type: &str,
    param: Option<&str>,
) -> String {
    openai_error_value(status, message, err_type, param).to_string()
}

fn bad(field: impl Into<String>, why: impl Into<String>) -> RequestError {
    RequestError::BadField {
        field: field.into(),
        why: why.into(),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses and validates a request body for `kind`.
pub fn parse_request(kind: ApiKind, body: &[u8]) -> Result<ParsedRequest, RequestError> {
    let text = std::str::from_utf8(body).map_err(|e| RequestError::InvalidUtf8 {
        valid_up_to: e.valid_up_to(),
    })?;
    let body: Value = serde_json::from_str(text).map_err(|e| RequestError::InvalidJson {
        message: json_error_message(&e),
        line: e.line(),
        column: e.column(),
    })?;
    let obj = body.as_object().ok_or(RequestError::NotAnObject)?;

    let model = match obj.get("model") {
        None | Some(Value::Null) => return Err(RequestError::MissingModel),
        Some(Value::String(s)) if s.trim().is_empty() => {
            return Err(bad("model", "must be a non-empty string"))
        }
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(bad(
                "model",
                format!("must be a string, got {}", type_name(other)),
            ))
        }
    };

    let stream = opt_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => match so.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(bad(
                    "stream_options.include_usage",
                    format!("must be a boolean, got {}", type_name(other)),
                ))
            }
        },
        Some(other) => {
            return Err(bad(
                "stream_options",
                format!("must be an object, got {}", type_name(other)),
            ))
        }
    };

    // vLLM: `max_completion_tokens or max_tokens`; both are validated when present.
    let max_tokens = match kind {
        ApiKind::ChatCompletions => {
            let mct = opt_token_count(obj, "max_completion_tokens")?;
            let mt = opt_token_count(obj, "max_tokens")?;
            mct.or(mt)
        }
        ApiKind::Completions => opt_token_count(obj, "max_tokens")?,
        ApiKind::Responses => opt_token_count(obj, "max_output_tokens")?,
    };

    let cache_salt = match opt_salt(obj.get("cache_salt"), "cache_salt")? {
        Some(s) => Some(s),
        None => match obj.get("nvext") {
            None | Some(Value::Null) => None,
            Some(Value::Object(nv)) => opt_salt(nv.get("cache_salt"), "nvext.cache_salt")?,
            Some(other) => {
                return Err(bad(
                    "nvext",
                    format!("must be an object, got {}", type_name(other)),
                ))
            }
        },
    };

    let input = match kind {
        ApiKind::ChatCompletions => parse_chat_input(obj)?,
        ApiKind::Completions => parse_completion_prompt(obj)?,
        ApiKind::Responses => parse_responses_input(obj)?,
    };

    Ok(ParsedRequest {
        kind,
        model,
        stream,
        include_usage,
        max_tokens,
        cache_salt,
        lora_name: None,
        input,
        body,
    })
}

/// serde_json's message without its trailing " at line L column C" (we report those fields).
fn json_error_message(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

fn opt_bool(obj: &Map<String, Value>, field: &str) -> Result<Option<bool>, RequestError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(bad(
            field,
            format!("must be a boolean, got {}", type_name(other)),
        )),
    }
}

fn opt_token_count(obj: &Map<String, Value>, field: &str) -> Result<Option<u32>, RequestError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            // Accept 16.0 like Python's pydantic does for ints; reject fractions.
            let v = if let Some(u) = n.as_u64() {
                u
            } else if let Some(f) = n.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0) {
                if f > u32::MAX as f64 {
                    u64::MAX
                } else {
                    f as u64
                }
            } else {
                return Err(bad(field, format!("must be a positive integer, got {n}")));
            };
            if v == 0 {
                return Err(bad(field, "must be at least 1"));
            }
            u32::try_from(v)
                .map(Some)
                .map_err(|_| bad(field, format!("must be at most {}, got {v}", u32::MAX)))
        }
        Some(other) => Err(bad(
            field,
            format!("must be an integer, got {}", type_name(other)),
        )),
    }
}

fn opt_salt(v: Option<&Value>, field: &str) -> Result<Option<String>, RequestError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Err(bad(field, "must be a non-empty string")),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(bad(
            field,
            format!("must be a string, got {}", type_name(other)),
        )),
    }
}

fn opt_object_field(obj: &Map<String, Value>, field: &str) -> Result<Option<Value>, RequestError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => Ok(Some(v.clone())),
        Some(other) => Err(bad(
            field,
            format!("must be an object, got {}", type_name(other)),
        )),
    }
}

fn parse_chat_input(obj: &Map<String, Value>) -> Result<PromptInput, RequestError> {
    let messages = match obj.get("messages") {
        None | Some(Value::Null) => {
            return Err(RequestError::MissingField {
                field: "messages".into(),
            })
        }
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(bad(
                "messages",
                format!("must be an array, got {}", type_name(other)),
            ))
        }
    };
    if messages.is_empty() {
        return Err(bad("messages", "must contain at least one message"));
    }
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| normalize_message(m, &format!("messages[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(v @ Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                if !t.is_object() {
                    return Err(bad(format!("tools[{i}]"), "must be an object"));
                }
            }
            Some(v.clone())
        }
        Some(other) => {
            return Err(bad(
                "tools",
                format!("must be an array, got {}", type_name(other)),
            ))
        }
    };
    let template_kwargs = opt_object_field(obj, "chat_template_kwargs")?;
    Ok(PromptInput::Chat {
        messages,
        tools,
        template_kwargs,
    })
}

/// Joins text content parts with "\n" (vLLM's "string" content format, which is what a
/// text-only template such as Qwen3's expects).
fn content_text(content: Option<&Value>, field: &str) -> Result<String, RequestError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let pf = || format!("{field}[{j}]");
                match part {
                    Value::String(s) => texts.push(s.as_str()),
                    Value::Object(p) => {
                        let ty = p.get("type").and_then(Value::as_str).unwrap_or("text");
                        match ty {
                            "text" | "input_text" | "output_text" => match p.get("text") {
                                Some(Value::String(s)) => texts.push(s.as_str()),
                                _ => return Err(bad(pf(), "text part needs a string 'text'")),
                            },
                            "refusal" => match p.get("refusal") {
                                Some(Value::String(s)) => texts.push(s.as_str()),
                                _ => {
                                    return Err(bad(pf(), "refusal part needs a string 'refusal'"))
                                }
                            },
                            other => {
                                return Err(bad(
                                    pf(),
                                    format!(
                                        "content part type {other:?} is not supported by this text-only model"
                                    ),
                                ))
                            }
                        }
                    }
                    other => {
                        return Err(bad(
                            pf(),
                            format!("must be an object or a string, got {}", type_name(other)),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(bad(
            field,
            format!(
                "must be a string, an array of content parts or null, got {}",
                type_name(other)
            ),
        )),
    }
}

/// Builds the message the template sees: role, content (string), and when present
/// tool_calls (arguments as objects), tool_call_id, name, reasoning_content.
fn normalize_message(m: &Value, field: &str) -> Result<Value, RequestError> {
    let m = m
        .as_object()
        .ok_or_else(|| bad(field, format!("must be an object, got {}", type_name(m))))?;
    let role = match m.get("role") {
        Some(Value::String(r)) if !r.is_empty() => r.clone(),
        None | Some(Value::Null) => {
            return Err(RequestError::MissingField {
                field: format!("{field}.role"),
            })
        }
        Some(other) => {
            return Err(bad(
                format!("{field}.role"),
                format!("must be a non-empty string, got {}", type_name(other)),
            ))
        }
    };
    let content = content_text(m.get("content"), &format!("{field}.content"))?;
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.clone()));
    out.insert("content".into(), Value::String(content));
    if role == "assistant" {
        match m.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => {
                let calls = calls
                    .iter()
                    .enumerate()
                    .map(|(k, c)| normalize_tool_call(c, &format!("{field}.tool_calls[{k}]")))
                    .collect::<Result<Vec<_>, _>>()?;
                out.insert("tool_calls".into(), Value::Array(calls));
            }
            Some(other) => {
                return Err(bad(
                    format!("{field}.tool_calls"),
                    format!("must be an array, got {}", type_name(other)),
                ))
            }
        }
        for key in ["reasoning_content", "reasoning"] {
            if let Some(Value::String(r)) = m.get(key) {
                // Qwen3's template reads `reasoning_content`; vLLM accepts `reasoning` too.
                out.insert("reasoning_content".into(), Value::String(r.clone()));
                break;
            }
        }
    }
    if role == "tool" {
        if let Some(Value::String(id)) = m.get("tool_call_id") {
            out.insert("tool_call_id".into(), Value::String(id.clone()));
        }
    }
    if let Some(Value::String(name)) = m.get("name") {
        out.insert("name".into(), Value::String(name.clone()));
    }
    Ok(Value::Object(out))
}

/// vLLM parses `function.arguments` from its JSON string before templating, so templates
/// render it with their own `tojson`; unparseable strings are left as they are.
fn normalize_tool_call(c: &Value, field: &str) -> Result<Value, RequestError> {
    let mut c = c
        .as_object()
        .ok_or_else(|| bad(field, format!("must be an object, got {}", type_name(c))))?
        .clone();
    if let Some(Value::Object(f)) = c.get_mut("function") {
        if let Some(Value::String(args)) = f.get("arguments") {
            if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(args) {
                f.insert("arguments".into(), v);
            }
        }
    }
    Ok(Value::Object(c))
}

fn token_id(v: &Value, field: &str) -> Result<u32, RequestError> {
    v.as_u64()
        .and_then(|u| u32::try_from(u).ok())
        .ok_or_else(|| {
            bad(
                field,
                format!("token ids must be integers in [0, 2^32), got {v}"),
            )
        })
}

fn parse_completion_prompt(obj: &Map<String, Value>) -> Result<PromptInput, RequestError> {
    let prompt = match obj.get("prompt") {
        None | Some(Value::Null) => {
            return Err(RequestError::MissingField {
                field: "prompt".into(),
            })
        }
        Some(p) => p,
    };
    const BATCH: &str =
        "batched prompts (more than one) are not supported; send one prompt per request";
    match prompt {
        Value::String(s) => Ok(PromptInput::Text(s.clone())),
        Value::Array(items) if items.is_empty() => Err(bad("prompt", "must not be empty")),
        Value::Array(items) => match &items[0] {
            Value::String(s) if items.len() == 1 => Ok(PromptInput::Text(s.clone())),
            Value::String(_) => Err(bad("prompt", BATCH)),
            Value::Number(_) => items
                .iter()
                .enumerate()
                .map(|(i, v)| token_id(v, &format!("prompt[{i}]")))
                .collect::<Result<Vec<_>, _>>()
                .map(PromptInput::TokenIds),
            Value::Array(inner) if items.len() == 1 => {
                if inner.is_empty() {
                    return Err(bad("prompt", "must not be empty"));
                }
                inner
                    .iter()
                    .enumerate()
                    .map(|(i, v)| token_id(v, &format!("prompt[0][{i}]")))
                    .collect::<Result<Vec<_>, _>>()
                    .map(PromptInput::TokenIds)
            }
            Value::Array(_) => Err(bad("prompt", BATCH)),
            other => Err(bad(
                "prompt",
                format!(
                    "must be a string, an array of token ids, or an array of one of those; found {} inside",
                    type_name(other)
                ),
            )),
        },
        other => Err(bad(
            "prompt",
            format!(
                "must be a string or an array of token ids, got {}",
                type_name(other)
            ),
        )),
    }
}

/// Converts Responses API `instructions` + `input` to chat messages, and its flat function
/// tools to chat-completions tools, so the same chat template applies.
fn parse_responses_input(obj: &Map<String, Value>) -> Result<PromptInput, RequestError> {
    let mut messages = Vec::new();
    match obj.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(other) => {
            return Err(bad(
                "instructions",
                format!("must be a string, got {}", type_name(other)),
            ))
        }
    }
    match obj.get("input") {
        None | Some(Value::Null) => {
            return Err(RequestError::MissingField {
                field: "input".into(),
            })
        }
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(bad("input", "must not be empty"));
            }
            for (i, item) in items.iter().enumerate() {
                let field = format!("input[{i}]");
                let o = item.as_object().ok_or_else(|| {
                    bad(
                        &field,
                        format!("must be an object, got {}", type_name(item)),
                    )
                })?;
                let ty = o.get("type").and_then(Value::as_str).unwrap_or("message");
                match ty {
                    "message" => {
                        let mut m = normalize_message(item, &field)?;
                        if let Some(mo) = m.as_object_mut() {
                            // The Responses API calls the system role "developer" too.
                            if mo.get("role").and_then(Value::as_str) == Some("developer") {
                                mo.insert("role".into(), Value::String("system".into()));
                            }
                        }
                        messages.push(m);
                    }
                    "function_call" => {
                        let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                            bad(format!("{field}.name"), "function_call needs a string name")
                        })?;
                        let args = o.get("arguments").cloned().unwrap_or(json!("{}"));
                        let call = normalize_tool_call(
                            &json!({
                                "id": o.get("call_id").cloned().unwrap_or(Value::Null),
                                "type": "function",
                                "function": {"name": name, "arguments": args},
                            }),
                            &field,
                        )?;
                        // Consecutive calls belong to one assistant turn.
                        let merged = messages.last_mut().and_then(|last| {
                            let lo = last.as_object_mut()?;
                            if lo.get("role").and_then(Value::as_str) != Some("assistant") {
                                return None;
                            }
                            let calls = lo
                                .entry("tool_calls")
                                .or_insert_with(|| Value::Array(Vec::new()));
                            calls.as_array_mut().map(|a| a.push(call.clone()))
                        });
                        if merged.is_none() {
                            messages.push(json!({
                                "role": "assistant", "content": "", "tool_calls": [call]
                            }));
                        }
                    }
                    "function_call_output" => {
                        let output = content_text(o.get("output"), &format!("{field}.output"))?;
                        let mut m = json!({"role": "tool", "content": output});
                        if let Some(id) = o.get("call_id").and_then(Value::as_str) {
                            m["tool_call_id"] = Value::String(id.to_string());
                        }
                        messages.push(m);
                    }
                    // Reasoning items carry no prompt text for a chat template.
                    "reasoning" => {}
                    other => {
                        return Err(bad(
                            format!("{field}.type"),
                            format!("input item type {other:?} is not supported"),
                        ))
                    }
                }
            }
        }
        Some(other) => {
            return Err(bad(
                "input",
                format!("must be a string or an array, got {}", type_name(other)),
            ))
        }
    }
    if messages.is_empty() {
        return Err(bad("input", "contains no messages"));
    }
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => {
            let mut out = Vec::new();
            for (i, t) in a.iter().enumerate() {
                let to = t
                    .as_object()
                    .ok_or_else(|| bad(format!("tools[{i}]"), "must be an object"))?;
                if to.get("type").and_then(Value::as_str) != Some("function") {
                    continue; // built-in tools (web search, ...) have no template rendering
                }
                if to.contains_key("function") {
                    out.push(t.clone());
                    continue;
                }
                let mut f = Map::new();
                for key in ["name", "description", "parameters", "strict"] {
                    if let Some(v) = to.get(key) {
                        f.insert(key.into(), v.clone());
                    }
                }
                out.push(json!({"type": "function", "function": Value::Object(f)}));
            }
            (!out.is_empty()).then_some(Value::Array(out))
        }
        Some(other) => {
            return Err(bad(
                "tools",
                format!("must be an array, got {}", type_name(other)),
            ))
        }
    };
    let template_kwargs = opt_object_field(obj, "chat_template_kwargs")?;
    Ok(PromptInput::Chat {
        messages,
        tools,
        template_kwargs,
    })
}
