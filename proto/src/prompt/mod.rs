//! Prompt understanding: turns a [`ParsedRequest`] into the text and token ids the engine sees.
//!
//! [`PromptRenderer`] loads a HF model dir (`tokenizer.json` + `tokenizer_config.json`, or a
//! `chat_template.jinja` beside them), renders the chat template with minijinja the way
//! transformers' `apply_chat_template(messages, tools=..., add_generation_prompt=True,
//! tokenize=False, **chat_template_kwargs)` does (jinja2 `trim_blocks` + `lstrip_blocks`,
//! Python string methods via minijinja-contrib `pycompat`, HF's `tojson` and
//! `raise_exception`), then tokenizes like vLLM: chat text without special tokens, completion
//! text with them. The EPP and the simulated worker both use this, so the block hashes the
//! router computes match the ones the worker publishes.
//!
//! All tokenization goes through [`PromptRenderer::encode`] so a faster encoder can replace
//! the `tokenizers` crate in one place.

pub mod pyjson;

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::{Map, Value};

use crate::openai::{ParsedRequest, PromptInput};
use crate::tokenizer::{FastTokenizer, PrefixReuseEncoder};

/// Template name used inside the renderer's environment.
const TEMPLATE: &str = "chat_template";
/// The template HF selects when `tools` are passed and the config has a named `tool_use` one.
const TOOL_TEMPLATE: &str = "tool_use";

#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid {path}: {why}")]
    Config { path: PathBuf, why: String },
    #[error("cannot load tokenizer {path}: {message}")]
    LoadTokenizer { path: PathBuf, message: String },
    #[error("model dir {0} has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")]
    NoChatTemplate(PathBuf),
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    #[error("cannot render the chat template: {0}")]
    Render(String),
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    #[error("detokenization failed: {0}")]
    Decode(String),
}

impl PromptError {
    /// Errors caused by the request (a template `raise_exception`, an unrenderable message)
    /// are the client's (400); the rest are the server's (500).
    pub fn http_status(&self) -> u16 {
        match self {
            PromptError::Render(_) | PromptError::Tokenize(_) | PromptError::Decode(_) => 400,
            _ => 500,
        }
    }
}

/// Renders chat templates and tokenizes prompts for one model. `Send + Sync`; share it in an
/// `Arc`.
pub struct PromptRenderer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    env: Environment<'static>,
    has_template: bool,
    has_tool_template: bool,
    /// `bos_token`, `eos_token`, ... as the template sees them (HF's `special_tokens_map`).
    special_tokens: Map<String, Value>,
    eos_token_id: Option<u32>,
    /// The fast exact encoder with prefix reuse (issue 5), when it supports this model.
    fast: Option<PrefixReuseEncoder>,
}

/// Remembered prompts for prefix reuse (deltas per conversation turn; a cold prompt keeps its
/// text and ids, so about 256 x 70 KB for 8K-token prompts).
const REUSE_CAPACITY: usize = 256;

/// [`FastTokenizer`] for `tok_path` when it supports the file and `hf` has no tokens beyond the
/// file's (tokenizer_config.json can add some); `None` means [`PromptRenderer::encode`] uses HF.
fn fast_encoder(tok_path: &Path, hf: &tokenizers::Tokenizer) -> Option<PrefixReuseEncoder> {
    match FastTokenizer::from_file(tok_path) {
        Ok(Some(fast)) if fast.vocab_size() == hf.get_vocab_size(true) => {
            Some(PrefixReuseEncoder::new(fast, REUSE_CAPACITY))
        }
        Ok(Some(_)) => {
            tracing::info!("tokenizer_config.json adds tokens; tokenizing with HF tokenizers");
            None
        }
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(error = %e, "fast tokenizer unavailable; tokenizing with HF tokenizers");
            None
        }
    }
}

impl std::fmt::Debug for PromptRenderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptRenderer")
            .field("dir", &self.dir)
            .field("has_template", &self.has_template)
            .field("eos_token_id", &self.eos_token_id)
            .finish_non_exhaustive()
    }
}

/// A special token in tokenizer_config.json: a string or an AddedToken dict `{"content": ..}`.
fn token_content(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

fn read_to_string(path: &Path) -> Result<String, PromptError> {
    std::fs::read_to_string(path).map_err(|source| PromptError::Io {
        path: path.to_path_buf(),
        source,
    })
}

impl PromptRenderer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens, added
    /// tokens) and, when the config has no template, `chat_template.jinja` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<PromptRenderer, PromptError> {
        let tok_path = dir.join("tokenizer.json");
        let cfg_path = dir.join("tokenizer_config.json");
        let mut tokenizer = tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| {
            PromptError::LoadTokenizer {
                path: tok_path.clone(),
                message: e.to_string(),
            }
        })?;
        let cfg: Value = match std::fs::read_to_string(&cfg_path) {
            Ok(s) => serde_json::from_str(&s).map_err(|e| PromptError::Config {
                path: cfg_path.clone(),
                why: e.to_string(),
            })?,
            // A bare tokenizer.json is usable for completions; chat will say what is missing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Object(Map::new()),
            Err(source) => {
                return Err(PromptError::Io {
                    path: cfg_path,
                    source,
                })
            }
        };
        let cfg = cfg
            .as_object()
            .cloned()
            .ok_or_else(|| PromptError::Config {
                path: cfg_path.clone(),
                why: "not a JSON object".into(),
            })?;

        // HF adds the config's added tokens that tokenizer.json lacks.
        if let Some(Value::Object(added)) = cfg.get("added_tokens_decoder") {
            let mut missing = Vec::new();
            for tok in added.values() {
                let Some(content) = token_content(tok) else {
                    continue;
                };
                if tokenizer.token_to_id(content).is_none() {
                    let flag = |k: &str| tok.get(k).and_then(Value::as_bool).unwrap_or(false);
                    missing.push(
                        tokenizers::AddedToken::from(content.to_string(), flag("special"))
                            .lstrip(flag("lstrip"))
                            .rstrip(flag("rstrip"))
                            .single_word(flag("single_word"))
                            .normalized(
                                tok.get("normalized")
                                    .and_then(Value::as_bool)
                                    .unwrap_or(!flag("special")),
                            ),
                    );
                }
            }
            if !missing.is_empty() {
                tracing::debug!(
                    count = missing.len(),
                    "adding tokens from tokenizer_config.json"
                );
                tokenizer
                    .add_tokens(missing)
                    .map_err(|e| PromptError::LoadTokenizer {
                        path: cfg_path.clone(),
                        message: e.to_string(),
                    })?;
            }
        }

        let mut special_tokens = Map::new();
        for key in [
            "bos_token",
            "eos_token",
            "unk_token",
            "sep_token",
            "pad_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(t) = cfg.get(key).and_then(token_content) {
                special_tokens.insert(key.into(), Value::String(t.to_string()));
            }
        }
        if let Some(Value::Array(extra)) = cfg.get("additional_special_tokens") {
            let extra: Vec<Value> = extra
                .iter()
                .filter_map(token_content)
                .map(|s| Value::String(s.to_string()))
                .collect();
            special_tokens.insert("additional_special_tokens".into(), Value::Array(extra));
        }
        let eos_token_id = special_tokens
            .get("eos_token")
            .and_then(Value::as_str)
            .and_then(|t| tokenizer.token_to_id(t));

        // chat_template: a string, or (older HF) a list of {"name", "template"}.
        let mut templates: Vec<(String, String)> = Vec::new();
        match cfg.get("chat_template") {
            None | Some(Value::Null) => {
                let jinja = dir.join("chat_template.jinja");
                if jinja.exists() {
                    templates.push((TEMPLATE.into(), read_to_string(&jinja)?));
                }
            }
            Some(Value::String(s)) => templates.push((TEMPLATE.into(), s.clone())),
            Some(Value::Array(list)) => {
                for t in list {
                    let (Some(name), Some(src)) = (
                        t.get("name").and_then(Value::as_str),
                        t.get("template").and_then(Value::as_str),
                    ) else {
                        return Err(PromptError::Config {
                            path: cfg_path,
                            why: "chat_template list entries need string 'name' and 'template'"
                                .into(),
                        });
                    };
                    let name = if name == "default" { TEMPLATE } else { name };
                    templates.push((name.to_string(), src.to_string()));
                }
            }
            Some(_) => {
                return Err(PromptError::Config {
                    path: cfg_path,
                    why: "chat_template must be a string or a list".into(),
                })
            }
        }

        let mut env = new_environment();
        let mut has_template = false;
        let mut has_tool_template = false;
        for (name, src) in templates {
            has_template |= name == TEMPLATE;
            has_tool_template |= name == TOOL_TEMPLATE;
            env.add_template_owned(name, src)
                .map_err(|e| PromptError::TemplateSyntax(format!("{e:#}")))?;
        }

        let fast = fast_encoder(&tok_path, &tokenizer);
        Ok(PromptRenderer {
            dir: dir.to_path_buf(),
            fast,
            tokenizer,
            env,
            has_template,
            has_tool_template,
            special_tokens,
            eos_token_id,
        })
    }

    /// Chat → the rendered template; completions text → the prompt; token ids → their text.
    pub fn render(&self, req: &ParsedRequest) -> Result<String, PromptError> {
        match &req.input {
            PromptInput::Chat {
                messages,
                tools,
                template_kwargs,
            } => {
                // vLLM extensions: `add_generation_prompt` (default true) and `documents`.
                let add_generation_prompt = req
                    .body
                    .get("add_generation_prompt")
                    .and_then(Value::as_bool)
                    .unwrap_or(true);
                let documents = req.body.get("documents").filter(|d| d.is_array());
                self.render_chat(
                    messages,
                    tools.as_ref(),
                    documents,
                    template_kwargs.as_ref(),
                    add_generation_prompt,
                )
            }
            PromptInput::Text(text) => Ok(text.clone()),
            PromptInput::TokenIds(ids) => self.decode(ids),
        }
    }

    /// `apply_chat_template(messages, tools, documents, add_generation_prompt, tokenize=False,
    /// **kwargs)`. `messages` should be normalised as [`crate::openai::parse_request`] does.
    pub fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        documents: Option<&Value>,
        template_kwargs: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String, PromptError> {
        if !self.has_template {
            return Err(PromptError::NoChatTemplate(self.dir.clone()));
        }
        let name = if tools.is_some() && self.has_tool_template {
            TOOL_TEMPLATE
        } else {
            TEMPLATE
        };
        // HF: render(messages=, tools=, documents=, add_generation_prompt=,
        //            **special_tokens_map, **kwargs) — kwargs may override special tokens.
        let mut ctx = self.special_tokens.clone();
        if let Some(Value::Object(kw)) = template_kwargs {
            for (k, v) in kw {
                ctx.insert(k.clone(), v.clone());
            }
        }
        ctx.insert("messages".into(), Value::Array(messages.to_vec()));
        ctx.insert("tools".into(), tools.cloned().unwrap_or(Value::Null));
        ctx.insert(
            "documents".into(),
            documents.cloned().unwrap_or(Value::Null),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template(name)
            .map_err(|e| PromptError::Render(format!("{e:#}")))?;
        tmpl.render(minijinja::Value::from_serialize(&ctx))
            .map_err(|e| PromptError::Render(render_error_message(&e)))
    }

    /// The token ids the engine sees. Chat: `encode(render, add_special_tokens=false)`;
    /// completions text: `encode(text, add_special_tokens=true)`; token ids as given. The body's
    /// `add_special_tokens` (a vLLM extension) overrides the default.
    pub fn token_ids(&self, req: &ParsedRequest) -> Result<Vec<u32>, PromptError> {
        let add_special = req.body.get("add_special_tokens").and_then(Value::as_bool);
        match &req.input {
            PromptInput::Chat { .. } => {
                let text = self.render(req)?;
                self.encode(&text, add_special.unwrap_or(false))
            }
            PromptInput::Text(text) => self.encode(text, add_special.unwrap_or(true)),
            PromptInput::TokenIds(ids) => Ok(ids.clone()),
        }
    }

    /// Whether [`PromptRenderer::encode`] uses kvroute's fast exact encoder (else HF).
    pub fn uses_fast_tokenizer(&self) -> bool {
        self.fast.is_some()
    }

    /// Tokenizes `text`. The single tokenization entry point (see the module doc).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        if let Some(fast) = &self.fast {
            return fast
                .encode(text, add_special_tokens)
                .map_err(|e| PromptError::Tokenize(e.to_string()));
        }
        let enc = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| PromptError::Tokenize(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Detokenizes `ids`, keeping special tokens (so `decode(encode(x)) == x`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, PromptError> {
        self.decode_with(ids, false)
    }

    /// Detokenizes `ids`, optionally dropping special tokens as vLLM does for output text.
    pub fn decode_with(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, PromptError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| PromptError::Decode(e.to_string()))
    }

    /// The id of `eos_token` from tokenizer_config.json.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// The id of a token string (special or regular), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The model dir this renderer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A `raise_exception("msg")` from the template surfaces as its message alone.
fn render_error_message(e: &JinjaError) -> String {
    if e.kind() == ErrorKind::InvalidOperation {
        if let Some(detail) = e.detail() {
            return detail.to_string();
        }
    }
    format!("{e:#}")
}

/// A minijinja environment configured like HF transformers' `ImmutableSandboxedEnvironment`
/// for chat templates.
fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", pyjson::tojson_filter);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn renderer_from(template: &str) -> PromptRenderer {
        PromptRenderer {
            dir: PathBuf::from("/nonexistent"),
            tokenizer: tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default()),
            env: {
                let mut env = new_environment();
                env.add_template_owned(TEMPLATE, template.to_string())
                    .unwrap();
                env
            },
            has_template: true,
            has_tool_template: false,
            special_tokens: Map::new(),
            eos_token_id: None,
            fast: None,
        }
    }

    #[test]
    fn raise_exception_is_a_client_error() {
        let r = renderer_from("{{ raise_exception('roles must alternate') }}");
        let err = r.render_chat(&[], None, None, None, true).unwrap_err();
        assert_eq!(err.http_status(), 400);
        assert_eq!(
            err.to_string(),
            "cannot render the chat template: roles must alternate"
        );
    }

    #[test]
    fn trims_blocks_and_uses_python_methods() {
        let r = renderer_from(
            "{% for m in messages %}\n  {{ m.content.strip() | upper }}|{{ m | tojson }}\n{% endfor %}",
        );
        let msgs = vec![serde_json::json!({"role": "user", "content": " hi<> "})];
        assert_eq!(
            r.render_chat(&msgs, None, None, None, true).unwrap(),
            "  HI<>|{\"role\": \"user\", \"content\": \" hi<> \"}\n"
        );
    }
}
