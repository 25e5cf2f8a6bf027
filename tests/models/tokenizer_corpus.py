"""Mixed strings for tokenizer parity tests (deterministic, a few hundred).

Hand-written cases cover what pre-tokenizers and vocabularies disagree on:
contractions in every case, digit runs, whitespace runs of every kind,
Unicode scripts, combining marks, emoji sequences, code, and text that looks
like special tokens.  Generated cases mix the same pools at random (a fixed
seed), so the corpus is the same on every run.
"""

from __future__ import annotations

import random

HAND: list[str] = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "Hello world",
    " Hello world",
    "Hello  world",
    "Hello   world   ",
    "hello\nworld\n",
    "line one\r\nline two\r\n",
    "trailing spaces   ",
    "   leading spaces",
    "tabs\tand\t\ttabs",
    "mixed \t \n \r\n whitespace",
    "\n\n\n\n\n\n",
    " \n \n ",
    "I'm here, you're there; it's OK, we'll see, they've gone, he'd go.",
    "I'M HERE, YOU'RE THERE; IT'S OK, WE'LL SEE, THEY'VE GONE, HE'D GO.",
    "I'm 'quoted' text with 'single' quotes and don't",
    "O'Neil's dog's bone'",
    "'s 't 're 've 'm 'll 'd",
    "1",
    "12",
    "123",
    "1234",
    "12345678901234567890",
    "3.14159 2.71828 -1e-10 +6.02e23",
    "version 1.2.3-rc.4+build.567",
    "0x1F 0b1010 0o777 1_000_000",
    "Phone: +1 (555) 123-4567",
    "２０２４年１２月",
    "x² + y³ = z⁴, ½ ¼ ¾, ①②③",
    "Ⅻ and ⅷ roman numerals",
    "café naïve résumé façade",
    "cafe\u0301 (decomposed é)",
    "Straße, Übermaß, Ärger",
    "Ελληνικά γράμματα",
    "Русский текст, ёжик",
    "中文文本，测试分词器。",
    "日本語のテキスト、ひらがなとカタカナ。",
    "한국어 텍스트 테스트",
    "العربية نص تجريبي",
    "עברית טקסט",
    "हिन्दी पाठ परीक्षण",
    "ภาษาไทย ทดสอบ",
    "Tiếng Việt có dấu",
    "emoji 😀😃😄 and 👍🏽 thumbs",
    "family 👨‍👩‍👧‍👦 zwj",
    "flags 🇺🇸🇫🇷🇯🇵",
    "🤖🧠💡🔥✨",
    "keycap 1️⃣ #️⃣",
    "def foo(x, y=2):\n    return x ** y  # power\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "const f = async (a) => { await g(a); };",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    "<html><body><div class=\"x\">Hi &amp; bye</div></body></html>",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "if __name__ == \"__main__\":\n\tmain()\n",
    "    indented\n        more\n            most\n",
    "a\u00a0b\u2003c\u3000d",
    "zero\u200bwidth\u200cjoiner\u200d",
    "soft\u00adhyphen",
    "nel\u0085line",
    "control\x01\x02\x1f chars",
    "del\x7f char",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|>",
    "<|im_end|>trailing",
    "<|endoftext|>",
    "<|im_",
    "<|im_start",
    "im_start|>",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk>",
    "<s>text</s>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<think>reasoning</think>answer",
    "[INST] mistral [/INST]",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>",
    "<0x41> byte token text",
    "▁already▁escaped▁spaces",
    "▁",
    "Ġ ġ Ċ",
    "!!!???...,,,;;;:::",
    "--- *** ### ___ === +++",
    "a.b,c;d:e!f?g",
    "$100 €50 £30 ¥2000 ₹500",
    "email@example.com https://example.org/path?q=1&r=2#frag",
    "C:\\Users\\name\\file.txt",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "a" * 100,
    "ab" * 50,
    " " * 40,
    "\t" * 12,
    "\n" * 40,
    "😀" * 10,
    "The quick brown fox jumps over the lazy dog.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
]

_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " " * 6 + "\t\n\r",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "éèêëàâäôöûüçñßøåæœ",
    "αβγδεζηθλμπσφψωАБВГДЕЖЗИЙ",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
    "あいうえおかきくけこアイウエオカキクケコ",
    "가나다라마바사아자차카타파하",
    "😀🎉🚀❤️👍🏽🇯🇵🤖",
    "\u0301\u0308\u0327",
    "²³¹¼½¾①②③",
    "\u00a0\u2003\u3000\u200b",
]
_WORDS = [
    "the", "The", "THE", "tokenizer", "don't", "it's", "I'll", "we've", "<|im_end|>",
    "<|im_start|>", "<end_of_turn>", "<start_of_turn>", "<tool_call>", "</tool_call>",
    "print(", "):", "return", "12345", "3.14", "naïve", "日本", "한국", "🙂", "\n\n", "  ",
]


def generated(n: int = 220, seed: int = 28) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(n):
        parts: list[str] = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.4:
                parts.append(rng.choice(_WORDS))
            else:
                pool = rng.choice(_POOLS)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
            if rng.random() < 0.5:
                parts.append(" ")
        out.append("".join(parts))
    return out


def corpus() -> list[str]:
    """The hand-written strings, then the generated ones."""
    return HAND + generated()
