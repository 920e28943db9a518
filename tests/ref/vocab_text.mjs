// vocab_text.mjs - a deterministic text of at least `bytes` UTF-8 bytes for the tokenizer
// comparisons (test_vocab_npm.mjs, bench/bench_vocab.mjs): code, prose with contractions, CJK,
// emoji (ZWJ sequences, skin tones, flags, variation selectors), RTL (Arabic and Hebrew with
// their marks), combining marks (decomposed accents, Devanagari, Thai), digit runs (ASCII,
// Arabic-Indic, fullwidth), whitespace runs (spaces, tabs, CR LF, NBSP, U+3000) and the special
// tokens of the vocabulary, drawn by a seeded generator. Only code points assigned since Unicode
// 13 or earlier, so that every Unicode table in play (ICU 72, V8's, llama.cpp's) agrees.
export function makeText(bytes, specials, seed = 12345) {
  let s = seed >>> 0;
  const rnd = () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const pick = (a) => a[Math.floor(rnd() * a.length)];
  const int = (lo, hi) => lo + Math.floor(rnd() * (hi - lo + 1));
  const code = [
    "int main(int argc, char **argv) {\n\tfor (int i = 0; i < argc; i++)\n\t\tprintf(\"%s\\n\", argv[i]);\n\treturn 0;\n}\n",
    "def f(x):\n    if x <= 0:\n        return []\n    return [y ** 2 for y in range(x)]  # squares\n",
    "const m = new Map([[1, 'a'], [2, \"b\"]]);\nfor (const [k, v] of m) console.log(`${k}=${v}`);\n",
    "SELECT id, name FROM users WHERE age >= 21 AND name LIKE '%son';\r\n",
    "    x += y;;  //\t\tdone   \n\n\n",
    "{\"key\": [1, 2.5, -3e10, true, null], \"k2\": {\"a\": \"\\u00e9\"}}\n",
    "<div class=\"a\">&amp; &lt;tag&gt;</div>\n",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }\n",
  ];
  const prose = [
    "It's a test, isn't it? I'M sure we'll see. They've said you'd LL and 're... ",
    "The quick brown fox jumps over the lazy dog. ",
    "Don't stop; CAN'T stop! O'Neil's dog's bone -- 'quoted' \"double\" ",
    "Numbers: 3.14159, 1,000,000 and 2^64-1 = 18446744073709551615. ",
    "Ünïcödé façade naïve coöperate Ærøskøbing Straße İstanbul ſ ",
    "Ελληνικά κείμενα και Русский текст с ёжиками. ",
    "Mixed—dashes – and “curly quotes” ‘single’ … ellipsis • bullet ",
    "€100 £5 ¥3000 ₹42 ∑∫√∞ ≤≥≠ →⇒↔ ©®™ ",
  ];
  const cjk = [
    "中文字符测试，这是一个句子。", "日本語のテキストとカタカナ、ひらがな。", "한국어 문장입니다. ",
    "漢字混じり文：東京都渋谷区", "「引用」『二重』【括弧】", "我爱北京天安门123",
  ];
  const emoji = [
    "🚀", "😶‍🌫️", "👩🏽‍💻", "🇩🇪🇯🇵", "❤️", "👍🏿", "🧑‍🤝‍🧑", "✋🏻", "🏳️‍🌈", "1️⃣", "😀😃😄", "🐍",
  ];
  const rtl = [
    "مرحبا بالعالم، هذا نص عربي.", "السَّلَامُ عَلَيْكُمْ", "שלום עולם, זה טקסט בעברית.", "בְּרֵאשִׁית",
    "English مع عربي mixed", "٠١٢٣٤٥٦٧٨٩",
  ];
  const marks = [
    "e\u0301", "a\u0300a\u0300", "n\u0303", "o\u0308", "re\u0301sume\u0301", "Cafe\u0301",
    "नमस्ते दुनिया", "क्षत्रिय", "สวัสดีครับ", "ภาษาไทย", "\u0301\u0302", "x\u20dd", "Z\u0336",
  ];
  const ws = () => {
    const k = int(0, 9);
    if (k < 3) return " ".repeat(int(1, 12));
    if (k < 5) return "\t".repeat(int(1, 4));
    if (k < 6) return "\r\n".repeat(int(1, 3));
    if (k < 7) return "\n".repeat(int(1, 5)) + " ".repeat(int(0, 4));
    if (k < 8) return " \u00a0 \u3000";
    return "  \n \t\n";
  };
  const digits = () => {
    const k = int(0, 5);
    const n = int(1, 24);
    let d = "";
    for (let i = 0; i < n; i++) {
      if (k < 4) d += String.fromCharCode(48 + int(0, 9));
      else if (k < 5) d += String.fromCharCode(0x660 + int(0, 9));
      else d += String.fromCharCode(0xff10 + int(0, 9));
    }
    return d;
  };
  const parts = [];
  let len = 0;
  const enc = new TextEncoder();
  while (len < bytes) {
    const k = int(0, 9);
    let p;
    if (k === 0) p = pick(code);
    else if (k === 1) p = pick(prose);
    else if (k === 2) p = pick(cjk);
    else if (k === 3) p = pick(emoji) + pick(emoji);
    else if (k === 4) p = pick(rtl);
    else if (k === 5) p = pick(marks);
    else if (k === 6) p = digits();
    else if (k === 7) p = ws();
    else if (k === 8) p = specials.length ? pick(specials) : " ";
    else p = pick(prose).split(" ").slice(0, int(1, 6)).join(" ");
    parts.push(p);
    len += enc.encode(p).length;
  }
  return parts.join("");
}
