//! Differential tests of `kvroute_proto::tokenizer` against HF `tokenizers` (issue 5): the fast
//! encoder and the prefix-reuse encoder must produce exactly HF's ids for the real Qwen3
//! `tokenizer.json`, on a generated corpus (English, code, CJK, emoji, digits, whitespace runs,
//! special tokens in text, combining marks, random bytes), on every Unicode code point in
//! several contexts, on multi-turn chat-template renders grown turn by turn, and on a
//! Llama-3-style variant of the file. The model files come from `./dev setup`; without them
//! these tests fail (they never pass vacuously).

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_proto::tokenizer::{FastTokenizer, PrefixReuseEncoder, TokenEncoder};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokenizers::Tokenizer;

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/models/qwen3")
        });
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{}/tokenizer.json is missing: run `./dev setup` (or set KVROUTE_MODEL_DIR)",
        dir.display()
    );
    dir
}

struct Fixture {
    hf: Tokenizer,
    fast: FastTokenizer,
    json: String,
    chat_template: String,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = model_dir();
        let path = dir.join("tokenizer.json");
        let hf = Tokenizer::from_file(&path).expect("HF loads tokenizer.json");
        let fast = FastTokenizer::from_file(&path)
            .expect("fast tokenizer loads")
            .expect("Qwen3 tokenizer.json is supported by the fast path");
        let json = std::fs::read_to_string(&path).unwrap();
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        let chat_template = cfg["chat_template"].as_str().unwrap().to_string();
        Fixture {
            hf,
            fast,
            json,
            chat_template,
        }
    })
}

fn hf_ids(hf: &Tokenizer, text: &str, add_special: bool) -> Vec<u32> {
    hf.encode(text, add_special).unwrap().get_ids().to_vec()
}

#[track_caller]
fn assert_same(hf: &Tokenizer, fast: &FastTokenizer, text: &str) {
    for add_special in [false, true] {
        let want = hf_ids(hf, text, add_special);
        let got = fast.encode(text, add_special);
        if want != got {
            let first = want
                .iter()
                .zip(&got)
                .position(|(a, b)| a != b)
                .unwrap_or(want.len().min(got.len()));
            panic!(
                "ids differ for {text:?} (add_special={add_special}) at index {first}:\n  hf:   {:?}\n  fast: {:?}",
                &want[first.saturating_sub(3)..(first + 5).min(want.len())],
                &got[first.saturating_sub(3)..(first + 5).min(got.len())],
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Corpus generator (also mirrored by the fuzz target's structured mode).

const WORDS: &[&str] = &[
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "Router",
    "KV",
    "cache",
    "token",
    "tokenization",
    "request",
    "conversation",
    "don't",
    "I'M",
    "she'LL",
    "we've",
    "they're",
    "it's",
    "O'Neil",
    "rock'n'roll",
    "naïve",
    "café",
    "Zürich",
    "résumé",
    "straße",
    "ſtate",
    "Kelvin",
    "İstanbul",
    "ﬆop",
    "HTTP/2",
    "e.g.",
    "i.e.",
    "U.S.A.",
    "self-attention",
    "pre-fill",
    "Llama",
    "Qwen3",
    "GPT-4o",
    "α",
    "βeta",
    "Ωmega",
    "Привет",
    "мир",
    "שלום",
    "مرحبا",
    "नमस्ते",
    "สวัสดี",
    "ελληνικά",
    "a",
    "I",
    "x",
    "y",
    "z",
];
const PUNCT: &[&str] = &[
    ".", ",", "!", "?", ";", ":", "...", "--", "-", "'", "\"", "(", ")", "[", "]", "{", "}", "''",
    "'s", "'S", "'ll", "'LL", "'re", "'ve", "'d", "'m", "'t", "'x", "’s", "`", "~", "@", "#", "$",
    "%", "^", "&", "*", "=>", "::", "!=", "<=", "->", "/*", "*/", "//", "\\", "|", "«", "»", "“",
    "”", "„", "、", "。", "，", "！", "？", "「", "」", "…", "·", "§",
];
const CODE: &[&str] = &[
    "fn main() {\n    println!(\"hello, {}\", name);\n}\n",
    "def f(x):\n\treturn x ** 2  # square\n",
    "if (a != b && c <= d) { return -1; }\r\n",
    "for i in range(10):\n        print(i)\n\n\n",
    "const X: [u8; 4] = [0x1F, 0xff, 255, 0o17];",
    "SELECT * FROM t WHERE id = 42;\n",
    "    \n  \t \n",
    "<div class=\"a\">&nbsp;</div>",
    "{\"role\": \"user\", \"content\": \"hi\"}",
    "x=1;y=22;z=333;w=4444",
    "$ cargo test -p kvroute-proto --test tokenizer_diff\n",
];
const SPECIALS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|vision_pad|>",
    "<|im_",
    "<|im_start|",
    "im_end|>",
    "<<|im_end|>>",
    "<|im_start|><|im_end|>",
    "<tool_response>",
    "</tool_response>",
];
const SPACES: &[&str] = &[
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", " \n", "\n ", " \n \n  ", "\u{a0}",
    "\u{3000}", "\u{2003}", "\u{85}", "\u{b}", "\u{c}", "\u{1680}", "\u{2028}", "\u{200b}",
    "\u{feff}", " \u{a0} ", "\t \n\t",
];
const COMBINING: &[&str] = &[
    "e\u{301}",
    "\u{301}",
    "a\u{308}\u{301}",
    "\u{1100}\u{1161}\u{11a8}",
    "\u{212b}",
    "\u{212a}",
    "\u{958}",
    "\u{344}",
    "\u{f900}",
    "A\u{30a}",
    "\u{fb01}",
    "\u{2126}",
    "o\u{323}\u{302}",
    "\u{1e0b}\u{323}",
    "\u{ac00}\u{11a8}",
    "\u{305}\u{301}\u{316}",
];

fn random_char(rng: &mut StdRng) -> char {
    loop {
        let cp = match rng.random_range(0..10) {
            0..=2 => rng.random_range(0x20..0x7F),
            3 => rng.random_range(0x80..0x800),
            4 => rng.random_range(0x4E00..0xA000),
            5 => rng.random_range(0x3000..0x3100),
            6 => rng.random_range(0xAC00..0xD7A4),
            7 => rng.random_range(0x1F300..0x1FAFF),
            8 => rng.random_range(0..0x20),
            _ => rng.random_range(0..0x11_0000),
        };
        if let Some(c) = char::from_u32(cp) {
            return c;
        }
    }
}

fn fragment(rng: &mut StdRng) -> String {
    let pick = |rng: &mut StdRng, xs: &[&str]| xs[rng.random_range(0..xs.len())].to_string();
    match rng.random_range(0..14) {
        0..=2 => {
            let n = rng.random_range(1..12);
            (0..n)
                .map(|_| pick(rng, WORDS))
                .collect::<Vec<_>>()
                .join(if rng.random_bool(0.8) { " " } else { "" })
        }
        3 => pick(rng, PUNCT),
        4 => pick(rng, CODE),
        5 => pick(rng, SPECIALS),
        6 => pick(rng, SPACES),
        7 => pick(rng, COMBINING),
        8 => {
            // Digit runs in several scripts, with separators.
            let n = rng.random_range(1..25);
            (0..n)
                .map(|_| match rng.random_range(0..12) {
                    0 => '\u{660}',
                    1 => '\u{ff13}',
                    2 => '²',
                    3 => '½',
                    4 => 'Ⅻ',
                    5 => ',',
                    6 => '.',
                    _ => char::from(b'0' + rng.random_range(0..10u8)),
                })
                .collect()
        }
        9 => {
            // CJK / kana / hangul runs with CJK punctuation.
            let n = rng.random_range(1..40);
            (0..n)
                .map(|_| match rng.random_range(0..10) {
                    0 => '，',
                    1 => '。',
                    2 => char::from_u32(rng.random_range(0x3041..0x3097)).unwrap_or('あ'),
                    3 => char::from_u32(rng.random_range(0xAC00..0xD7A4)).unwrap_or('가'),
                    _ => char::from_u32(rng.random_range(0x4E00..0x9FA6)).unwrap_or('中'),
                })
                .collect()
        }
        10 => {
            // Emoji, ZWJ sequences, skin tones, flags.
            let opts = [
                "😀",
                "👍🏽",
                "👨\u{200d}👩\u{200d}👧",
                "🇺🇸",
                "🇯🇵🇫🇷",
                "❤️",
                "🤖",
                "✨✨",
                "🧑🏿\u{200d}💻",
            ];
            opts[rng.random_range(0..opts.len())].to_string()
        }
        11 => {
            // Random bytes read as UTF-8 (lossy), as a client might send.
            let n = rng.random_range(1..24);
            let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        12 => {
            let n = rng.random_range(1..16);
            (0..n).map(|_| random_char(rng)).collect()
        }
        _ => {
            // Apostrophe contractions next to folding characters.
            let c = [
                's', 'S', 'ſ', 't', 'T', 'r', 'R', 'e', 'E', 'l', 'L', 'ß', 'ﬆ', 'K', 'K', 'd',
                'm', 'v',
            ];
            let mut s = String::from("'");
            for _ in 0..rng.random_range(1..4) {
                s.push(c[rng.random_range(0..c.len())]);
            }
            s
        }
    }
}

fn random_text(rng: &mut StdRng, max_fragments: usize) -> String {
    let n = rng.random_range(1..=max_fragments);
    let mut s = String::new();
    for _ in 0..n {
        s.push_str(&fragment(rng));
        match rng.random_range(0..6) {
            0 => s.push(' '),
            1 => s.push('\n'),
            _ => {}
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------

/// Regenerates (with `KVROUTE_REGEN_UNICODE_TABLES=1`) or checks `unicode_tables.rs` against
/// Oniguruma, code point by code point, and checks the lookup the splitter uses.
#[test]
fn unicode_tables_match_oniguruma() {
    use tokenizers::utils::SysRegex;
    let whole = |pat: &str| SysRegex::new(&format!(r"\A(?:{pat})\z")).unwrap();
    let classes = [
        ("LETTER", whole(r"\p{L}"), 1u8),
        ("NUMBER", whole(r"\p{N}"), 2),
        ("WHITESPACE", whole(r"\s"), 4),
    ];
    let folds: Vec<(char, SysRegex)> = "strevmld"
        .chars()
        .map(|c| (c, whole(&format!("(?i:{c})"))))
        .collect();
    let matches = |re: &SysRegex, s: &str| re.find_iter(s).next() == Some((0, s.len()));

    let mut ranges: Vec<Vec<(u32, u32)>> = vec![Vec::new(); 3];
    let mut fold_sets: Vec<Vec<char>> = vec![Vec::new(); folds.len()];
    let mut mismatches = Vec::new();
    let mut buf = [0u8; 4];
    for cp in 0..=0x10_FFFFu32 {
        let Some(c) = char::from_u32(cp) else {
            continue;
        };
        let s = c.encode_utf8(&mut buf);
        let mut want = 0u8;
        for (i, (_, re, bit)) in classes.iter().enumerate() {
            if matches(re, s) {
                want |= bit;
                match ranges[i].last_mut() {
                    Some(r) if r.1 + 1 == cp => r.1 = cp,
                    _ => ranges[i].push((cp, cp)),
                }
            }
        }
        if kvroute_proto::tokenizer::regex_char_class(c) != want && mismatches.len() < 20 {
            mismatches.push((cp, want));
        }
        for (i, (_, re)) in folds.iter().enumerate() {
            if matches(re, s) {
                fold_sets[i].push(c);
            }
        }
    }

    let mut out = String::new();
    out.push_str("//! Character classes of the split regex, as Oniguruma (the engine HF `tokenizers` uses) sees them.\n");
    out.push_str("//! GENERATED by the `unicode_tables_match_oniguruma` test in `proto/tests/tokenizer_diff.rs`\n");
    out.push_str("//! (run it with `KVROUTE_REGEN_UNICODE_TABLES=1` to rewrite this file); that test also checks\n");
    out.push_str("//! every code point against Oniguruma on each run, so a `tokenizers`/`onig` upgrade that changes\n");
    out.push_str("//! the Unicode version fails loudly instead of tokenizing differently.\n\n");
    for (i, (name, _, _)) in classes.iter().enumerate() {
        let what = ["\\p{L}", "\\p{N}", "\\s"][i];
        out.push_str(&format!("/// `{what}`: inclusive code point ranges.\n"));
        out.push_str(&format!(
            "#[rustfmt::skip]\npub(crate) static {name}: &[(u32, u32)] = &[\n"
        ));
        for chunk in ranges[i].chunks(6) {
            let line: Vec<String> = chunk
                .iter()
                .map(|(a, b)| format!("(0x{a:04X}, 0x{b:04X})"))
                .collect();
            out.push_str(&format!("    {},\n", line.join(", ")));
        }
        out.push_str("];\n");
    }
    for (i, (letter, _)) in folds.iter().enumerate() {
        out.push_str(&format!(
            "/// Characters that `(?i:{letter})` matches.\npub(crate) static FOLD_{}: &[char] = &[{}];\n",
            letter.to_ascii_uppercase(),
            fold_sets[i]
                .iter()
                .map(|c| format!("'\\u{{{:x}}}'", *c as u32))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/tokenizer/unicode_tables.rs");
    if std::env::var_os("KVROUTE_REGEN_UNICODE_TABLES").is_some() {
        std::fs::write(&path, &out).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap();
    assert!(
        committed == out,
        "{} is out of date with Oniguruma; regenerate with KVROUTE_REGEN_UNICODE_TABLES=1",
        path.display()
    );
    assert!(
        mismatches.is_empty(),
        "class lookup differs: {mismatches:x?}"
    );
}

/// The generated corpus: HF and the fast encoder agree on every text.
#[test]
fn generated_corpus_matches_hf() {
    let f = fixture();
    let mut rng = StdRng::seed_from_u64(0x006b_7672_6f75_7465);
    let cases = 20_000;
    for _ in 0..cases {
        let text = random_text(&mut rng, 12);
        assert_same(&f.hf, &f.fast, &text);
    }
    // A few long texts (long CJK letter runs take the heap BPE path).
    for _ in 0..40 {
        let text = random_text(&mut rng, 400);
        assert_same(&f.hf, &f.fast, &text);
    }
    assert_same(&f.hf, &f.fast, "");
    let cjk: String = (0..3000)
        .map(|i| char::from_u32(0x4E00 + (i * 37) % 20000).unwrap())
        .collect();
    assert_same(&f.hf, &f.fast, &cjk);
    assert_same(&f.hf, &f.fast, &"=".repeat(5000));
    assert_same(&f.hf, &f.fast, &" ".repeat(3000));
    assert_same(&f.hf, &f.fast, &"9".repeat(3000));
}

/// Every code point, alone and in the contexts the split regex treats specially: after an
/// apostrophe, after a space, between letters and digits, before a newline, doubled. Many
/// snippets share one text to keep HF's call count low; a difference names the text.
#[test]
fn every_code_point_in_context() {
    let f = fixture();
    let mut text = String::new();
    let mut count = 0usize;
    for cp in 0..=0x10_FFFFu32 {
        let Some(c) = char::from_u32(cp) else {
            continue;
        };
        let snippet = match cp % 6 {
            0 => format!("'{c} {c}{c}"),
            1 => format!(" {c}x1{c}\n"),
            2 => format!("a{c}'{c}e "),
            3 => format!("\t{c}  {c}."),
            4 => format!("{c}'ll {c}\u{301}"),
            _ => format!("<|im_end|>{c} \n{c}"),
        };
        text.push_str(&snippet);
        count += 1;
        if count.is_multiple_of(64) {
            assert_same(&f.hf, &f.fast, &text);
            text.clear();
        }
    }
    assert_same(&f.hf, &f.fast, &text);
}

/// Added tokens have the ids HF assigns.
#[test]
fn added_token_ids_match_hf() {
    let f = fixture();
    for (id, tok) in f.hf.get_added_tokens_decoder() {
        assert_eq!(
            f.fast.encode(&tok.content, false),
            vec![id],
            "{}",
            tok.content
        );
    }
}

fn render_chat(template: &str, messages: &[serde_json::Value]) -> String {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_template("t", template).unwrap();
    env.get_template("t")
        .unwrap()
        .render(minijinja::context! { messages => messages, add_generation_prompt => true })
        .unwrap()
}

/// Conversations grown turn by turn through the Qwen3 chat template, encoded with prefix
/// reuse: each turn equals a cold HF encode, and later turns do reuse.
#[test]
fn chat_conversations_with_prefix_reuse_match_hf() {
    let f = fixture();
    let fast = FastTokenizer::from_json_str(&f.json).unwrap().unwrap();
    let reuse = PrefixReuseEncoder::new(fast, 64);
    let mut rng = StdRng::seed_from_u64(7);
    let mut turns = 0;
    for conv in 0..24 {
        let mut messages = vec![serde_json::json!({
            "role": "system",
            "content": format!("You are assistant #{conv}. {}", random_text(&mut rng, 6)),
        })];
        for _ in 0..8 {
            messages
                .push(serde_json::json!({"role": "user", "content": random_text(&mut rng, 30)}));
            let prompt = render_chat(&f.chat_template, &messages);
            let want = hf_ids(&f.hf, &prompt, false);
            assert_eq!(
                reuse.encode(&prompt, false).unwrap(),
                want,
                "turn prompt {prompt:?}"
            );
            turns += 1;
            let answer = if rng.random_bool(0.3) {
                format!(
                    "<think>\n{}\n</think>\n\n{}",
                    random_text(&mut rng, 10),
                    random_text(&mut rng, 20)
                )
            } else {
                random_text(&mut rng, 25)
            };
            messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        }
    }
    let stats = reuse.stats();
    assert!(stats.hits > turns as u64 / 2, "reuse rarely hit: {stats:?}");
    assert!(stats.reused_tokens > stats.encoded_tokens, "{stats:?}");
}

/// A long conversation (deeper than the reuse rope's flattening depth) where every turn also
/// branches from three turns back with a different user message: continuations link to older
/// remembered texts, not just the latest one.
#[test]
fn deep_and_branching_conversations_with_prefix_reuse_match_hf() {
    let f = fixture();
    let fast = FastTokenizer::from_json_str(&f.json).unwrap().unwrap();
    let reuse = PrefixReuseEncoder::new(fast, 16);
    let mut rng = StdRng::seed_from_u64(19);
    let mut messages = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
    let mut history: Vec<Vec<serde_json::Value>> = Vec::new();
    for turn in 0..70 {
        messages.push(serde_json::json!({"role": "user", "content": random_text(&mut rng, 8)}));
        let prompt = render_chat(&f.chat_template, &messages);
        assert_eq!(
            reuse.encode(&prompt, false).unwrap(),
            hf_ids(&f.hf, &prompt, false),
            "turn {turn}"
        );
        if let Some(old) = history.len().checked_sub(3).map(|i| history[i].clone()) {
            let mut branch = old;
            branch.push(serde_json::json!({"role": "user", "content": random_text(&mut rng, 8)}));
            let prompt = render_chat(&f.chat_template, &branch);
            assert_eq!(
                reuse.encode(&prompt, false).unwrap(),
                hf_ids(&f.hf, &prompt, false),
                "branch {turn}"
            );
        }
        messages
            .push(serde_json::json!({"role": "assistant", "content": random_text(&mut rng, 8)}));
        history.push(messages.clone());
    }
    let stats = reuse.stats();
    assert!(stats.hits > 100 && stats.evictions > 0, "{stats:?}");
}

/// Adversarial reuse: a remembered text is cut at a random byte (inside whitespace runs, words,
/// digit runs, special tokens...) and continued with random text; the result equals HF's.
#[test]
fn prefix_reuse_at_arbitrary_cuts_matches_hf() {
    let f = fixture();
    let fast = FastTokenizer::from_json_str(&f.json).unwrap().unwrap();
    let reuse = PrefixReuseEncoder::new(fast, 8);
    let mut rng = StdRng::seed_from_u64(11);
    let mut cases = 0;
    for _ in 0..150 {
        let base = random_text(&mut rng, 120);
        assert_eq!(
            reuse.encode(&base, true).unwrap(),
            hf_ids(&f.hf, &base, true)
        );
        for _ in 0..8 {
            let mut cut = rng.random_range(0..=base.len());
            while !base.is_char_boundary(cut) {
                cut -= 1;
            }
            let mut text = base[..cut].to_string();
            // Continuations that stress the boundary rules: whitespace, combining marks,
            // letters, digits, partial special tokens.
            for _ in 0..rng.random_range(1..4) {
                text.push_str(&fragment(&mut rng));
            }
            assert_eq!(
                reuse.encode(&text, false).unwrap(),
                hf_ids(&f.hf, &text, false),
                "cut at {cut} of {base:?} continued as {text:?}"
            );
            cases += 1;
        }
    }
    assert!(cases > 1000);
    assert!(reuse.stats().hits > 100, "{:?}", reuse.stats());
}

/// The Llama-3 variant of the split pattern (`\p{N}{1,3}`) with `ignore_merges` and a BOS
/// template post-processor, built from the Qwen3 file, against HF loading the same JSON.
#[test]
fn llama3_style_variant_matches_hf() {
    let f = fixture();
    let mut json: serde_json::Value = serde_json::from_str(&f.json).unwrap();
    json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = serde_json::Value::String(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+".into(),
    );
    json["normalizer"] = serde_json::Value::Null;
    json["model"]["ignore_merges"] = serde_json::Value::Bool(true);
    json["post_processor"] = serde_json::json!({
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643], "tokens": ["<|endoftext|>"]}}}
        ]
    });
    let text = json.to_string();
    let hf: Tokenizer = text.parse().unwrap();
    let fast = FastTokenizer::from_json_str(&text)
        .unwrap()
        .expect("variant is supported");
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..3000 {
        assert_same(&hf, &fast, &random_text(&mut rng, 12));
    }
    assert_eq!(fast.encode("1234567", true)[0], 151643);
}

/// Unsupported features are detected at load: the fast path declines, the fallback is HF.
#[test]
fn unsupported_files_fall_back_to_hf() {
    let f = fixture();
    let mut json: serde_json::Value = serde_json::from_str(&f.json).unwrap();
    json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+|\\w+".into();
    assert!(FastTokenizer::from_json_str(&json.to_string())
        .unwrap()
        .is_none());
    let mut json: serde_json::Value = serde_json::from_str(&f.json).unwrap();
    json["normalizer"] = serde_json::json!({"type": "NFKC"});
    assert!(FastTokenizer::from_json_str(&json.to_string())
        .unwrap()
        .is_none());
    let mut json: serde_json::Value = serde_json::from_str(&f.json).unwrap();
    json["added_tokens"][0]["lstrip"] = true.into();
    assert!(FastTokenizer::from_json_str(&json.to_string())
        .unwrap()
        .is_none());
    assert!(FastTokenizer::from_json_str("not json").is_err());
    let mut json: serde_json::Value = serde_json::from_str(&f.json).unwrap();
    json["model"]["merges"][5] = serde_json::json!(["no-such-token", "x"]);
    assert!(FastTokenizer::from_json_str(&json.to_string()).is_err());

    let enc = TokenEncoder::from_file(&model_dir().join("tokenizer.json")).unwrap();
    assert!(enc.is_fast());
    let hf_enc = TokenEncoder::from(f.hf.clone());
    let reuse = PrefixReuseEncoder::new(hf_enc, 4);
    let text = "<|im_start|>user\nhello world<|im_end|>\n";
    assert_eq!(
        reuse.encode(text, false).unwrap(),
        hf_ids(&f.hf, text, false)
    );
}

/// The prompt renderer tokenizes through the fast encoder (with prefix reuse) for Qwen3, and
/// its ids for a growing conversation equal HF's.
#[test]
fn prompt_renderer_uses_the_fast_encoder() {
    let f = fixture();
    let r = kvroute_proto::prompt::PromptRenderer::from_dir(&model_dir()).unwrap();
    assert!(r.uses_fast_tokenizer());
    let mut rng = StdRng::seed_from_u64(23);
    let mut messages = Vec::new();
    for _ in 0..6 {
        messages.push(serde_json::json!({"role": "user", "content": random_text(&mut rng, 20)}));
        let prompt = r.render_chat(&messages, None, None, None, true).unwrap();
        assert_eq!(
            r.encode(&prompt, false).unwrap(),
            hf_ids(&f.hf, &prompt, false)
        );
        messages
            .push(serde_json::json!({"role": "assistant", "content": random_text(&mut rng, 20)}));
    }
}

/// The encoders are shared across the EPP's request tasks.
#[test]
fn encoders_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<FastTokenizer>();
    check::<PrefixReuseEncoder>();
    check::<TokenEncoder>();
}
