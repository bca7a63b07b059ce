//! libFuzzer-free driver for the same property (`kvroute_fuzz::check`), for stable toolchains:
//! a seeded mutation loop over a built-in seed corpus (English, code, CJK, emoji, digits,
//! whitespace runs, special tokens, combining marks, contractions). Each input is a seed or a
//! previous input mutated by byte flips, insertions of interesting fragments, splices and
//! truncations; every 64th input is random bytes.
//!
//! ```text
//! cargo run --release --no-default-features --bin diff_loop -- <iterations> [seed]
//! ```

use std::time::Instant;

const SEEDS: &[&str] = &[
    "Hello world, it's a test. Don't STOP'LL we've they're",
    "fn main() {\n    println!(\"{}\", x);\n}\n",
    "  \t\n\r\n   \u{a0}\u{3000}x  \n\n y",
    "路由器根据键值缓存选择节点。トークン化 한국어 텍스트",
    "😀👍🏽👨\u{200d}👩\u{200d}👧🇺🇸",
    "1234567890 ١٢٣ １２３ ²½Ⅻ 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "e\u{301} \u{212b} \u{958} \u{1100}\u{1161} a\u{308}\u{301} \u{344}",
    "'s 'S 'ſ 'll 'LL 're 'Ve 'ß 'ﬆ",
    "<|im_<|im_end|>> <tool_call>{\"a\": 1}</tool_call>",
];
const FRAGMENTS: &[&str] = &[
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "'",
    "'s",
    "<|im_end|>",
    "<|im_start|>",
    "<think>",
    "0",
    "42",
    "\u{301}",
    "\u{a0}",
    "\u{3000}",
    "中",
    "ſ",
    "K",
    "😀",
    "\u{200d}",
    "a",
    "Z",
    ".",
    "!!",
    "\u{85}",
];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

fn mutate(rng: &mut Rng, input: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        let len = input.len();
        match rng.below(6) {
            0 if len > 0 => {
                let i = rng.below(len);
                input[i] ^= 1 << rng.below(8);
            }
            1 => {
                let f = FRAGMENTS[rng.below(FRAGMENTS.len())].as_bytes();
                let at = rng.below(len + 1);
                input.splice(at..at, f.iter().copied());
            }
            2 => {
                let s = SEEDS[rng.below(SEEDS.len())].as_bytes();
                let a = rng.below(s.len());
                let b = a + rng.below(s.len() - a + 1);
                let at = rng.below(len + 1);
                input.splice(at..at, s[a..b].iter().copied());
            }
            3 if len > 2 => {
                let a = rng.below(len);
                let b = a + rng.below(len - a);
                input.drain(a..b);
            }
            4 if len > 0 => {
                let i = rng.below(len);
                input[i] = rng.next() as u8;
            }
            _ => {
                let a = rng.below(len + 1);
                let b = a + rng.below(len - a + 1);
                let copy: Vec<u8> = input[a..b].to_vec();
                input.extend_from_slice(&copy);
            }
        }
    }
    input.truncate(2048);
}

fn main() {
    let mut args = std::env::args().skip(1);
    let iterations: u64 = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let seed: u64 = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(0x6b76_726f_7574_6521);
    let mut rng = Rng(seed | 1);
    kvroute_fuzz::harness();
    let start = Instant::now();
    let mut current: Vec<u8> = Vec::new();
    for i in 0..iterations {
        if i % 64 == 0 {
            current = (0..rng.below(64)).map(|_| rng.next() as u8).collect();
        } else if i % 16 == 0 || current.len() > 1500 {
            current = SEEDS[rng.below(SEEDS.len())].as_bytes().to_vec();
        }
        mutate(&mut rng, &mut current);
        let mut input = Vec::with_capacity(current.len() + 1);
        input.push(rng.next() as u8);
        input.extend_from_slice(&current);
        kvroute_fuzz::check(&input);
        if (i + 1) % 100_000 == 0 {
            eprintln!(
                "{} inputs, 0 differences, {:.0}s",
                i + 1,
                start.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "{iterations} inputs checked against HF tokenizers, 0 differences ({:.0}s)",
        start.elapsed().as_secs_f64()
    );
}
