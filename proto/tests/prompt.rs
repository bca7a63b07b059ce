//! Prompt understanding against the real Qwen3 tokenizer files: OpenAI request parsing
//! (errors and fields), chat-template rendering and token ids.
//!
//! Expected strings and ids were produced once with Python: jinja2 configured exactly like HF
//! transformers' chat-template environment (trim_blocks, lstrip_blocks, HF's `tojson`) and
//! `tokenizers` 0.23.3 `Tokenizer.from_file(...).encode(text, add_special_tokens=...)`; the
//! rendered strings were also checked by hand against the template in tokenizer_config.json.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvroute_proto::openai::{
    openai_error_body, parse_request, ApiKind, ParsedRequest, PromptInput, RequestError,
};
use kvroute_proto::prompt::PromptRenderer;
use serde_json::{json, Value};

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/models/qwen3")
        });
    assert!(
        dir.join("tokenizer.json").exists() && dir.join("tokenizer_config.json").exists(),
        "Qwen3 tokenizer files not found in {}: run `./dev setup` (or set KVROUTE_MODEL_DIR)",
        dir.display()
    );
    dir
}

fn renderer() -> Arc<PromptRenderer> {
    static R: OnceLock<Arc<PromptRenderer>> = OnceLock::new();
    R.get_or_init(|| Arc::new(PromptRenderer::from_dir(&model_dir()).expect("load renderer")))
        .clone()
}

fn chat(body: Value) -> ParsedRequest {
    parse_request(ApiKind::ChatCompletions, body.to_string().as_bytes()).expect("valid chat")
}

fn parse_err(kind: ApiKind, body: &[u8]) -> RequestError {
    parse_request(kind, body).expect_err("should be rejected")
}

// ---------------------------------------------------------------- parsing: errors

#[test]
fn rejects_malformed_bodies() {
    let chat = ApiKind::ChatCompletions;
    let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
    let cases: Vec<(ApiKind, Vec<u8>, &str, Option<&str>)> = vec![
        (chat, b"{not json".to_vec(), "not valid JSON", None),
        (chat, b"".to_vec(), "not valid JSON", None),
        (chat, b"{\"model\": \"m\xff\"}".to_vec(), "not valid UTF-8", None),
        (chat, b"[1, 2]".to_vec(), "must be a JSON object", None),
        (chat, format!("{{{msgs}}}").into_bytes(), "missing required field 'model'", Some("model")),
        (chat, format!("{{\"model\":null,{msgs}}}").into_bytes(), "missing required field 'model'", Some("model")),
        (chat, format!("{{\"model\":7,{msgs}}}").into_bytes(), "must be a string, got a number", Some("model")),
        (chat, format!("{{\"model\":\"\",{msgs}}}").into_bytes(), "non-empty", Some("model")),
        (chat, br#"{"model":"m"}"#.to_vec(), "missing required field 'messages'", Some("messages")),
        (chat, br#"{"model":"m","messages":"hi"}"#.to_vec(), "must be an array, got a string", Some("messages")),
        (chat, br#"{"model":"m","messages":[]}"#.to_vec(), "at least one message", Some("messages")),
        (chat, br#"{"model":"m","messages":[3]}"#.to_vec(), "must be an object", Some("messages[0]")),
        (chat, br#"{"model":"m","messages":[{"content":"x"}]}"#.to_vec(), "missing required field 'messages[0].role'", Some("messages[0].role")),
        (chat, br#"{"model":"m","messages":[{"role":"user","content":5}]}"#.to_vec(), "must be a string, an array of content parts or null", Some("messages[0].content")),
        (chat, br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#.to_vec(), "not supported", Some("messages[0].content[0]")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"max_tokens\":\"10\"}}").into_bytes(), "must be an integer, got a string", Some("max_tokens")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"max_tokens\":-1}}").into_bytes(), "positive integer", Some("max_tokens")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"max_tokens\":1.5}}").into_bytes(), "positive integer", Some("max_tokens")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"max_tokens\":0}}").into_bytes(), "at least 1", Some("max_tokens")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"max_tokens\":4294967296}}").into_bytes(), "at most 4294967295", Some("max_tokens")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"max_completion_tokens\":true}}").into_bytes(), "must be an integer", Some("max_completion_tokens")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"stream\":\"yes\"}}").into_bytes(), "must be a boolean", Some("stream")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"stream_options\":[]}}").into_bytes(), "must be an object", Some("stream_options")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"stream_options\":{{\"include_usage\":1}}}}").into_bytes(), "must be a boolean", Some("stream_options.include_usage")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"cache_salt\":\"\"}}").into_bytes(), "non-empty string", Some("cache_salt")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"nvext\":{{\"cache_salt\":3}}}}").into_bytes(), "must be a string", Some("nvext.cache_salt")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"tools\":{{}}}}").into_bytes(), "must be an array", Some("tools")),
        (chat, format!("{{\"model\":\"m\",{msgs},\"chat_template_kwargs\":[]}}").into_bytes(), "must be an object", Some("chat_template_kwargs")),
        (ApiKind::Completions, br#"{"model":"m"}"#.to_vec(), "missing required field 'prompt'", Some("prompt")),
        (ApiKind::Completions, br#"{"model":"m","prompt":{}}"#.to_vec(), "must be a string or an array", Some("prompt")),
        (ApiKind::Completions, br#"{"model":"m","prompt":["a","b"]}"#.to_vec(), "batched prompts", Some("prompt")),
        (ApiKind::Completions, br#"{"model":"m","prompt":[1,-2]}"#.to_vec(), "token ids must be integers", Some("prompt[1]")),
        (ApiKind::Completions, br#"{"model":"m","prompt":[]}"#.to_vec(), "must not be empty", Some("prompt")),
        (ApiKind::Responses, br#"{"model":"m"}"#.to_vec(), "missing required field 'input'", Some("input")),
        (ApiKind::Responses, br#"{"model":"m","input":5}"#.to_vec(), "must be a string or an array", Some("input")),
        (ApiKind::Responses, br#"{"model":"m","input":"x","max_output_tokens":"5"}"#.to_vec(), "must be an integer", Some("max_output_tokens")),
    ];
    for (kind, body, want, param) in cases {
        let err = parse_err(kind, &body);
        let shown = String::from_utf8_lossy(&body);
        assert!(
            err.to_string().contains(want),
            "{shown}: {err} should contain {want:?}"
        );
        assert_eq!(err.http_status(), 400, "{shown}");
        let j = err.openai_error_json();
        assert_eq!(j["error"]["type"], "invalid_request_error", "{shown}");
        assert_eq!(j["error"]["code"], 400, "{shown}");
        assert_eq!(j["error"]["message"], err.to_string(), "{shown}");
        assert_eq!(j["error"]["param"].as_str(), param, "{shown}: param");
    }
}

#[test]
fn json_error_reports_position() {
    let err = parse_err(ApiKind::Completions, b"{\n  \"model\": }");
    match err {
        RequestError::InvalidJson { line, column, .. } => assert_eq!((line, column), (2, 12)),
        other => panic!("unexpected {other:?}"),
    }
    let err = parse_err(ApiKind::Completions, b"ab\xc3\x28");
    assert_eq!(err, RequestError::InvalidUtf8 { valid_up_to: 2 });
}

#[test]
fn error_body_has_openai_shape() {
    let body: Value = serde_json::from_str(&openai_error_body(
        404,
        "no such model",
        "not_found_error",
        None,
    ))
    .unwrap();
    assert_eq!(
        body,
        json!({"error": {"message": "no such model", "type": "not_found_error", "param": null, "code": 404}})
    );
}

// ---------------------------------------------------------------- parsing: fields

#[test]
fn api_kind_from_path() {
    assert_eq!(
        ApiKind::from_path("/v1/chat/completions"),
        Some(ApiKind::ChatCompletions)
    );
    assert_eq!(
        ApiKind::from_path("/v1/chat/completions?foo=bar"),
        Some(ApiKind::ChatCompletions)
    );
    assert_eq!(
        ApiKind::from_path("/v1/completions/"),
        Some(ApiKind::Completions)
    );
    assert_eq!(
        ApiKind::from_path("/v1/responses"),
        Some(ApiKind::Responses)
    );
    assert_eq!(ApiKind::from_path("/v1/models"), None);
    assert_eq!(ApiKind::from_path("/v1/chat/completionsx"), None);
    assert_eq!(ApiKind::Completions.path(), "/v1/completions");
}

#[test]
fn extracts_chat_fields() {
    let req = chat(json!({
        "model": "Qwen/Qwen3-0.6B",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi", "name": "bob"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [2]}"}}
            ]},
            {"role": "tool", "tool_call_id": "c", "content": "ok", "extra": 1}
        ],
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": 7,
        "max_completion_tokens": 9,
        "nvext": {"cache_salt": "tenant-a"},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": false},
        "temperature": 0.5
    }));
    assert_eq!(req.kind, ApiKind::ChatCompletions);
    assert_eq!(req.model, "Qwen/Qwen3-0.6B");
    assert!(req.stream && req.include_usage);
    assert_eq!(req.max_tokens, Some(9), "max_completion_tokens wins");
    assert_eq!(req.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(req.lora_name, None);
    assert_eq!(req.body["temperature"], 0.5);
    let PromptInput::Chat {
        messages,
        tools,
        template_kwargs,
    } = &req.input
    else {
        panic!("chat input expected")
    };
    assert_eq!(
        messages,
        &vec![
            json!({"role": "system", "content": "a\nb"}),
            json!({"role": "user", "content": "hi", "name": "bob"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [2]}}}
            ]}),
            json!({"role": "tool", "content": "ok", "tool_call_id": "c"}),
        ]
    );
    // Key order is the client's (serde_json preserve_order), as Python dicts keep it.
    let args = &messages[2]["tool_calls"][0]["function"]["arguments"];
    assert_eq!(args.to_string(), r#"{"z":1,"a":[2]}"#);
    assert_eq!(
        tools,
        &Some(json!([{"type": "function", "function": {"name": "f"}}]))
    );
    assert_eq!(template_kwargs, &Some(json!({"enable_thinking": false})));

    // Defaults, body-level cache_salt, plain max_tokens.
    let req = chat(
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "max_tokens": 3, "cache_salt": "s", "nvext": {"cache_salt": "ignored"},
                          "stream": null, "stream_options": {"include_usage": false}}),
    );
    assert!(!req.stream && !req.include_usage);
    assert_eq!(req.max_tokens, Some(3));
    assert_eq!(req.cache_salt.as_deref(), Some("s"));
    let req = chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}));
    assert_eq!(
        (req.max_tokens, req.cache_salt, req.stream),
        (None, None, false)
    );
}

#[test]
fn extracts_completion_prompts() {
    let parse = |v: Value| parse_request(ApiKind::Completions, v.to_string().as_bytes()).unwrap();
    let req = parse(json!({"model": "m", "prompt": "Hello", "max_tokens": 16, "stream": true}));
    assert_eq!(req.input, PromptInput::Text("Hello".into()));
    assert_eq!(req.max_tokens, Some(16));
    assert!(req.stream);
    assert_eq!(
        parse(json!({"model": "m", "prompt": ["Hi"]})).input,
        PromptInput::Text("Hi".into())
    );
    assert_eq!(
        parse(json!({"model": "m", "prompt": [1, 2, 3]})).input,
        PromptInput::TokenIds(vec![1, 2, 3])
    );
    assert_eq!(
        parse(json!({"model": "m", "prompt": [[4, 5]]})).input,
        PromptInput::TokenIds(vec![4, 5])
    );
    // max_completion_tokens is a chat-only field.
    assert_eq!(
        parse(json!({"model": "m", "prompt": "x", "max_completion_tokens": 5})).max_tokens,
        None
    );
}

#[test]
fn converts_responses_input_to_chat() {
    let req = parse_request(
        ApiKind::Responses,
        json!({
            "model": "m",
            "instructions": "Be terse.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"c\": \"P\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "message", "role": "developer", "content": "note"}
            ],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}, {"type": "web_search"}],
            "max_output_tokens": 12,
            "stream": true
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(req.max_tokens, Some(12));
    assert!(req.stream);
    let PromptInput::Chat {
        messages, tools, ..
    } = &req.input
    else {
        panic!("chat expected")
    };
    assert_eq!(
        messages,
        &vec![
            json!({"role": "system", "content": "Be terse."}),
            json!({"role": "user", "content": "Weather?"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"c": "P"}}}
            ]}),
            json!({"role": "tool", "content": "sunny", "tool_call_id": "c1"}),
            json!({"role": "system", "content": "note"}),
        ]
    );
    assert_eq!(
        tools,
        &Some(
            json!([{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}])
        )
    );
    let simple = parse_request(ApiKind::Responses, br#"{"model":"m","input":"Hi"}"#).unwrap();
    assert_eq!(
        simple.input,
        PromptInput::Chat {
            messages: vec![json!({"role": "user", "content": "Hi"})],
            tools: None,
            template_kwargs: None
        }
    );
}

// ---------------------------------------------------------------- rendering

/// (case, request body, expected text, expected ids of encode(text, add_special_tokens=false)).
fn chat_vectors() -> Vec<(&'static str, Value, &'static str, Vec<u32>)> {
    vec![
        (
            "multi_turn",
            json!({"model": "m", "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "2+2 equals 4."},
                {"role": "user", "content": "And 3+3?"}
            ]}),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n2+2 equals 4.<|im_end|>\n\
             <|im_start|>user\nAnd 3+3?<|im_end|>\n\
             <|im_start|>assistant\n",
            vec![
                151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872,
                198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198, 17, 10, 17,
                16819, 220, 19, 13, 151645, 198, 151644, 872, 198, 3036, 220, 18, 10, 18, 30,
                151645, 198, 151644, 77091, 198,
            ],
        ),
        (
            // Assistant turns before the last user query lose their <think> block.
            "think_history",
            json!({"model": "m", "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
                {"role": "user", "content": "Tell me a joke."}
            ]}),
            "<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello! How can I help?<|im_end|>\n\
             <|im_start|>user\nTell me a joke.<|im_end|>\n\
             <|im_start|>assistant\n",
            vec![
                151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198, 9707, 0, 2585, 646,
                358, 1492, 30, 151645, 198, 151644, 872, 198, 40451, 752, 264, 21646, 13, 151645,
                198, 151644, 77091, 198,
            ],
        ),
        (
            "no_thinking",
            json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                   "chat_template_kwargs": {"enable_thinking": false}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
            vec![
                151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198, 151667, 271, 151668,
                271,
            ],
        ),
        (
            // Tools in the system turn (HF tojson: ", "/": " separators, no HTML escaping,
            // client key order), a tool call with arguments as an object, a tool response.
            "tools",
            json!({"model": "m",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"unit\":\"celsius\"}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}
                ],
                "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
            }),
            "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n\
             {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather <now> & later\", \
             \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \
             \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}}, \"required\": [\"city\"]}}}\n\
             </tools>\n\nFor each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n\
             </tool_call><|im_end|>\n\
             <|im_start|>user\nWeather in Paris?<|im_end|>\n\
             <|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n",
            vec![
                151644, 8948, 198, 3430, 9814, 382, 2, 13852, 271, 2610, 1231, 1618, 825, 476,
                803, 5746, 311, 7789, 448, 279, 1196, 3239, 382, 2610, 525, 3897, 448, 729,
                32628, 2878, 366, 15918, 1472, 15918, 29, 11874, 9492, 510, 27, 15918, 397, 4913,
                1313, 788, 330, 1688, 497, 330, 1688, 788, 5212, 606, 788, 330, 455, 69364, 497,
                330, 4684, 788, 330, 28981, 366, 3328, 29, 609, 2937, 497, 330, 13786, 788, 5212,
                1313, 788, 330, 1700, 497, 330, 13193, 788, 5212, 8926, 788, 5212, 1313, 788, 330,
                917, 14345, 330, 3843, 788, 5212, 1313, 788, 330, 917, 497, 330, 9018, 788, 4383,
                66, 40247, 497, 330, 69, 47910, 1341, 38154, 330, 6279, 788, 4383, 8926, 1341,
                3417, 532, 522, 15918, 1339, 2461, 1817, 729, 1618, 11, 470, 264, 2951, 1633, 448,
                729, 829, 323, 5977, 2878, 220, 151657, 151658, 11874, 9492, 510, 151657, 198,
                4913, 606, 788, 366, 1688, 11494, 8066, 330, 16370, 788, 366, 2116, 56080, 40432,
                31296, 151658, 151645, 198, 151644, 872, 198, 28981, 304, 12095, 30, 151645, 198,
                151644, 77091, 198, 151657, 198, 4913, 606, 788, 330, 455, 69364, 497, 330, 16370,
                788, 5212, 8926, 788, 330, 59604, 497, 330, 3843, 788, 330, 66, 40247, 95642,
                151658, 151645, 198, 151644, 872, 198, 151665, 198, 4913, 3888, 788, 220, 17, 16,
                532, 151666, 151645, 198, 151644, 77091, 198,
            ],
        ),
        (
            // An assistant turn after the last user query keeps its reasoning in <think>.
            "reasoning_after_query",
            json!({"model": "m", "messages": [
                {"role": "user", "content": "Compute"},
                {"role": "assistant", "content": "Calling.", "reasoning_content": "I should call the tool.",
                 "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "content": "42"}
            ]}),
            "<|im_start|>user\nCompute<|im_end|>\n\
             <|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\nCalling.\n\
             <tool_call>\n{\"name\": \"calc\", \"arguments\": {\"x\": 1}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n",
            vec![
                151644, 872, 198, 46254, 151645, 198, 151644, 77091, 198, 151667, 198, 40, 1265,
                1618, 279, 5392, 624, 151668, 271, 48853, 624, 151657, 198, 4913, 606, 788, 330,
                26586, 497, 330, 16370, 788, 5212, 87, 788, 220, 16, 11248, 151658, 151645, 198,
                151644, 872, 198, 151665, 198, 19, 17, 198, 151666, 151645, 198, 151644, 77091,
                198,
            ],
        ),
    ]
}

#[test]
fn chat_template_matches_hf() {
    let r = renderer();
    for (name, body, want_text, want_ids) in chat_vectors() {
        let req = chat(body);
        let text = r.render(&req).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, want_text, "{name}: rendered text");
        assert_eq!(r.token_ids(&req).unwrap(), want_ids, "{name}: token ids");
    }
}

#[test]
fn generation_prompt_can_be_turned_off() {
    let r = renderer();
    let req = chat(
        json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                          "add_generation_prompt": false}),
    );
    assert_eq!(r.render(&req).unwrap(), "<|im_start|>user\nHi<|im_end|>\n");
}

#[test]
fn token_ids_match_hf_tokenizers() {
    let r = renderer();
    let vectors: Vec<(&str, Vec<u32>)> = vec![
        ("Hello world", vec![9707, 1879]),
        (
            " The quick brown fox jumps over the lazy dog.",
            vec![576, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13],
        ),
        (
            "naïve café 日本語 🤖",
            vec![
                3376, 37572, 586, 51950, 75402, 21894, 102819, 11162, 97, 244,
            ],
        ),
        (
            "x = 12345678;\n\n\tif (a<b) { return; }  ",
            vec![
                87, 284, 220, 16, 17, 18, 19, 20, 21, 22, 23, 401, 743, 320, 64, 33177, 8, 314,
                470, 26, 335, 256,
            ],
        ),
        (
            "<|im_start|>user\nhi<|im_end|>",
            vec![151644, 872, 198, 6023, 151645],
        ),
        ("I'm can't we'll", vec![40, 2776, 646, 944, 582, 3278]),
    ];
    for (text, want) in vectors {
        // Qwen3 adds no BOS/EOS, so both settings agree (checked in Python too).
        assert_eq!(r.encode(text, false).unwrap(), want, "{text:?}");
        assert_eq!(r.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(r.decode(&want).unwrap(), text, "{text:?} round trip");
    }
    assert_eq!(r.eos_token_id(), Some(151645));
    assert_eq!(r.token_to_id("<|endoftext|>"), Some(151643));
    assert_eq!(r.decode_with(&[151644, 872], true).unwrap(), "user");
}

#[test]
fn token_ids_for_chat_and_completions() {
    let r = renderer();
    // Chat: the rendered template, encoded without special tokens.
    let req = chat(json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}));
    let ids = r.token_ids(&req).unwrap();
    assert_eq!(ids, r.encode(&r.render(&req).unwrap(), false).unwrap());
    assert_eq!(
        ids,
        vec![151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]
    );

    // Completions text: the prompt itself, with special tokens (none for Qwen3).
    let req = parse_request(
        ApiKind::Completions,
        br#"{"model":"m","prompt":"Hello world"}"#,
    )
    .unwrap();
    assert_eq!(r.render(&req).unwrap(), "Hello world");
    assert_eq!(r.token_ids(&req).unwrap(), vec![9707, 1879]);

    // Completions token ids: passed through; render gives their text.
    let req = parse_request(
        ApiKind::Completions,
        br#"{"model":"m","prompt":[9707,1879]}"#,
    )
    .unwrap();
    assert_eq!(r.token_ids(&req).unwrap(), vec![9707, 1879]);
    assert_eq!(r.render(&req).unwrap(), "Hello world");

    // Responses API: same template as chat.
    let resp = parse_request(ApiKind::Responses, br#"{"model":"m","input":"Hi"}"#).unwrap();
    assert_eq!(r.token_ids(&resp).unwrap(), ids);
}

#[test]
fn renderer_is_shareable_and_reports_missing_files() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<PromptRenderer>();
    let err = PromptRenderer::from_dir(std::path::Path::new("/nonexistent/model")).unwrap_err();
    assert!(
        err.to_string()
            .contains("/nonexistent/model/tokenizer.json"),
        "{err}"
    );
}

#[test]
fn concurrent_rendering_agrees() {
    let r = renderer();
    let (_, body, want, _) = chat_vectors().remove(0);
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let r = r.clone();
            let body = body.clone();
            std::thread::spawn(move || r.render(&chat(body)).unwrap())
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), want);
    }
}
