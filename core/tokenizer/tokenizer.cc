#include "core/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <queue>
#include <sstream>
#include <utility>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/tokenizer/utf8.h"

namespace twinkle::tokenizer {
namespace {

using Json = nlohmann::json;

// absl may be built with its own string_view (Debian's is), which StrCat and the maps'
// heterogeneous lookup do not take from std.
absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// ---- GPT-2's bytes_to_unicode --------------------------------------------------------------

struct ByteLevelTable {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the code point standing for each byte
  std::array<int, 512> char_to_byte;          // code point → byte, -1 where none
};

const ByteLevelTable& ByteLevel() {
  static const ByteLevelTable* table = [] {
    auto* t = new ByteLevelTable;
    t->char_to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const int cp = printable ? b : next++;
      t->char_to_byte[cp] = b;
      t->byte_to_char[b] = utf8::Encode(static_cast<char32_t>(cp));
    }
    return t;
  }();
  return *table;
}

std::string ToByteLevel(std::string_view bytes) {
  const ByteLevelTable& table = ByteLevel();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += table.byte_to_char[static_cast<unsigned char>(c)];
  return out;
}

// The bytes a token string stands for under the ByteLevel decoder: every character mapped
// back through the table, or — when some character has no byte (added tokens such as
// "<|im_start|>" mostly map; ones with spaces or other characters do not) — the token's own
// UTF-8, as HF's ByteLevel decoder does per token.
std::string FromByteLevel(std::string_view token) {
  const ByteLevelTable& table = ByteLevel();
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const int32_t cp = utf8::DecodeAt(token, i);
    if (cp < 0 || cp >= 512 || table.char_to_byte[cp] < 0) return std::string(token);
    out.push_back(static_cast<char>(table.char_to_byte[cp]));
  }
  return out;
}

// ---- Regex (PCRE2) ---------------------------------------------------------------------------

// HF writes its pre-tokenizer regexes for Oniguruma. PCRE2 (UTF + UCP) reads them unchanged
// except for one class: Oniguruma's \s is exactly U+0009–U+000D, U+0085 and General_Category
// Z, while PCRE2's UCP \s is Z ∪ \h ∪ \v, which also holds U+180E. So \s and \S are spelled
// out here; this is the only translation (docs/tokenizer.md).
constexpr std::string_view kOnigSpace = "\\t\\n\\x{0B}\\f\\r\\x{85}\\p{Z}";

absl::StatusOr<std::string> OnigToPcre2(std::string_view pattern) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char n = pattern[++i];
      if (n == 's') {
        absl::StrAppend(&out, in_class ? std::string(kOnigSpace) : absl::StrCat("[", AV(kOnigSpace), "]"));
      } else if (n == 'S') {
        if (in_class) return absl::InvalidArgumentError("pre-tokenizer regex: \\S inside a character class is not supported");
        absl::StrAppend(&out, "[^", AV(kOnigSpace), "]");
      } else {
        out.push_back('\\');
        out.push_back(n);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out.push_back(pattern[++i]);
      continue;
    }
    if (in_class && c == '[') return absl::InvalidArgumentError("pre-tokenizer regex: nested character classes are not supported");
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  if (in_class) return absl::InvalidArgumentError("pre-tokenizer regex: unterminated character class");
  return out;
}

std::string QuotePcre2(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pcre2_pattern) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pcre2_pattern.data()), pcre2_pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
    if (code == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      return absl::InvalidArgumentError(absl::StrCat("pre-tokenizer regex does not compile at offset ", offset, ": ",
                                                     reinterpret_cast<const char*>(message.data())));
    }
    auto regex = std::unique_ptr<Regex>(new Regex(code));
    // JIT where the platform has it; the interpreter otherwise (same results).
    regex->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    return regex;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends [start, end) of every match in `text` (valid UTF-8) to `matches`.
  absl::Status FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    if (data == nullptr) return absl::ResourceExhaustedError("pre-tokenizer regex: no memory for match data");
    size_t start = 0;
    uint32_t options = PCRE2_NO_UTF_CHECK;
    while (start <= text.size()) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start, options, data.get(),
                           nullptr);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                         options | PCRE2_NO_JIT, data.get(), nullptr);
      }
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        std::array<PCRE2_UCHAR, 256> message{};
        pcre2_get_error_message(rc, message.data(), message.size());
        return absl::ResourceExhaustedError(absl::StrCat("pre-tokenizer regex failed at byte ", start, ": ",
                                                         reinterpret_cast<const char*>(message.data())));
      }
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
      const size_t begin = ovector[0], end = ovector[1];
      if (end > begin) {
        matches.emplace_back(begin, end);
        start = end;
      } else {
        // An empty match: step over one character (no pieces are empty).
        if (begin >= text.size()) break;
        start = begin + utf8::SequenceLength(static_cast<unsigned char>(text[begin]));
      }
    }
    return absl::OkStatus();
  }

  bool jit() const { return jit_; }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
  bool jit_ = false;
};

// GPT-2's pre-tokenizer regex, which HF's ByteLevel(use_regex=true) applies.
constexpr std::string_view kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- NFC (utf8proc) --------------------------------------------------------------------------

absl::StatusOr<std::string> Nfc(std::string_view text) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &out, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("NFC normalization failed: ", utf8proc_errmsg(n)));
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

// ---- Added tokens ------------------------------------------------------------------------------

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool single_word = false;
};

// Leftmost-longest literal matching over the added tokens' contents (a byte trie), as HF's
// Aho-Corasick automaton with MatchKind::LeftmostLongest finds them.
class AddedMatcher {
 public:
  void Add(const std::string& pattern, size_t token_index) {
    if (pattern.empty()) return;
    int node = 0;
    for (unsigned char c : pattern) {
      auto it = nodes_[node].next.find(c);
      if (it == nodes_[node].next.end()) {
        nodes_.push_back(Node{});
        it = nodes_[node].next.emplace(c, static_cast<int>(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    nodes_[node].token = static_cast<int>(token_index);
  }
  bool empty() const { return nodes_.size() == 1; }

  // The longest pattern starting at `pos`: (token index, length), or token index -1.
  std::pair<int, size_t> LongestAt(std::string_view text, size_t pos) const {
    int node = 0;
    std::pair<int, size_t> best{-1, 0};
    for (size_t i = pos; i < text.size(); ++i) {
      auto it = nodes_[node].next.find(static_cast<unsigned char>(text[i]));
      if (it == nodes_[node].next.end()) break;
      node = it->second;
      if (nodes_[node].token >= 0) best = {nodes_[node].token, i + 1 - pos};
    }
    return best;
  }

 private:
  struct Node {
    absl::flat_hash_map<unsigned char, int> next;
    int token = -1;
  };
  std::vector<Node> nodes_{Node{}};
};

// HF's single_word test: Rust regex's Unicode \w, i.e. Alphabetic (letters, Nl, and the
// Other_Alphabetic marks and circled letters), marks, decimal digits, connector punctuation and
// the joiners U+200C/U+200D.
bool IsWordChar(int32_t cp) {
  if (cp == 0x200C || cp == 0x200D) return true;
  if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F149) || (cp >= 0x1F150 && cp <= 0x1F169) ||
      (cp >= 0x1F170 && cp <= 0x1F189)) {
    return true;  // Other_Alphabetic symbols (circled and squared letters)
  }
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// Rust's char::is_whitespace (the White_Space property).
bool IsWhitespace(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// A piece of the input: either an added token (id >= 0) or text for the model.
struct Piece {
  std::string text;
  int32_t added_id = -1;
};

// ---- The tokenizer ---------------------------------------------------------------------------

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  std::unique_ptr<Regex> regex;  // kSplit, or kByteLevel with use_regex
  bool add_prefix_space = false;  // kByteLevel
};

struct PairHash {
  size_t operator()(const std::pair<int32_t, int32_t>& p) const {
    return absl::HashOf(p.first, p.second);
  }
};

// Token ids are below this (the largest vocabularies in use are ~262k): the id → bytes table
// is sized by the largest id, so a hostile file cannot make it huge.
constexpr int64_t kMaxVocabSize = int64_t{1} << 21;
constexpr size_t kCacheCapacity = 10000;  // words
constexpr size_t kCacheMaxWordBytes = 256;

class BpeTokenizer final : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Build(const Json& j);

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const override;
  std::string TokenBytes(int32_t id) const override {
    if (id < 0 || static_cast<size_t>(id) >= bytes_.size()) return "";
    return bytes_[id];
  }
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    if (auto it = added_by_content_.find(AV(token)); it != added_by_content_.end()) return added_[it->second].id;
    if (auto it = vocab_.find(AV(token)); it != vocab_.end()) return it->second;
    return std::nullopt;
  }
  bool IsSpecial(int32_t id) const override {
    auto it = added_by_id_.find(id);
    return it != added_by_id_.end() && added_[it->second].special;
  }
  int32_t vocab_size() const override { return static_cast<int32_t>(bytes_.size()); }

 private:
  absl::Status SplitAdded(std::string_view text, const AddedMatcher& matcher, std::vector<Piece>& out) const;
  absl::Status EncodeText(std::string_view text, std::vector<int32_t>& ids) const;
  void Bpe(const std::string& word, std::vector<int32_t>& ids) const;

  bool nfc_ = false;
  std::vector<PreTokenizerStep> pre_tokenizer_;
  absl::flat_hash_map<std::string, int32_t> vocab_;
  absl::flat_hash_map<std::pair<int32_t, int32_t>, std::pair<int32_t, int32_t>, PairHash> merges_;  // → (rank, id)
  bool ignore_merges_ = false;
  std::vector<AddedToken> added_;
  absl::flat_hash_map<std::string, size_t> added_by_content_;
  absl::flat_hash_map<int32_t, size_t> added_by_id_;
  AddedMatcher raw_matcher_;         // added tokens with normalized=false, on the raw text
  AddedMatcher normalized_matcher_;  // normalized=true ones, on the normalized text
  std::vector<std::string> bytes_;   // by id: the bytes each token decodes to
  std::vector<bool> known_;          // by id: whether the id is a token at all

  mutable absl::Mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_ ABSL_GUARDED_BY(cache_mu_);
};

absl::Status Unsupported(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: unsupported ", AV(what)));
}

absl::Status ParsePreTokenizer(const Json& p, std::vector<PreTokenizerStep>& steps) {
  if (!p.is_object()) return Unsupported("pre_tokenizer (not an object)");
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    auto it = p.find("pretokenizers");
    if (it == p.end() || !it->is_array()) return Unsupported("pre_tokenizer Sequence without a pretokenizers array");
    for (const Json& step : *it) {
      if (absl::Status s = ParsePreTokenizer(step, steps); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (type == "Split") {
    const std::string behavior = p.value("behavior", "");
    if (behavior != "Isolated") return Unsupported(absl::StrCat("pre_tokenizer Split behavior '", behavior, "' (only Isolated)"));
    if (p.value("invert", false)) return Unsupported("pre_tokenizer Split with invert=true");
    auto pattern = p.find("pattern");
    if (pattern == p.end() || !pattern->is_object()) return Unsupported("pre_tokenizer Split without a pattern");
    std::string pcre;
    if (auto r = pattern->find("Regex"); r != pattern->end() && r->is_string()) {
      absl::StatusOr<std::string> translated = OnigToPcre2(r->get<std::string>());
      if (!translated.ok()) return translated.status();
      pcre = *std::move(translated);
    } else if (auto s = pattern->find("String"); s != pattern->end() && s->is_string()) {
      pcre = QuotePcre2(s->get<std::string>());
    } else {
      return Unsupported("pre_tokenizer Split pattern (neither Regex nor String)");
    }
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::kSplit;
    absl::StatusOr<std::unique_ptr<Regex>> regex = Regex::Compile(pcre);
    if (!regex.ok()) return regex.status();
    step.regex = *std::move(regex);
    steps.push_back(std::move(step));
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    step.add_prefix_space = p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) {
      absl::StatusOr<std::string> translated = OnigToPcre2(kGpt2Regex);
      if (!translated.ok()) return translated.status();
      absl::StatusOr<std::unique_ptr<Regex>> regex = Regex::Compile(*translated);
      if (!regex.ok()) return regex.status();
      step.regex = *std::move(regex);
    }
    steps.push_back(std::move(step));
    return absl::OkStatus();
  }
  return Unsupported(absl::StrCat("pre_tokenizer type '", type, "'"));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> BpeTokenizer::Build(const Json& j) {
  auto tok = std::make_unique<BpeTokenizer>();

  // Normalizer: none or NFC (a Sequence of just NFC is the same).
  if (auto n = j.find("normalizer"); n != j.end() && !n->is_null()) {
    const Json* norm = &*n;
    if (norm->is_object() && norm->value("type", "") == "Sequence") {
      auto list = norm->find("normalizers");
      if (list == norm->end() || !list->is_array() || list->size() > 1) return Unsupported("normalizer Sequence (only one of NFC)");
      if (list->empty()) norm = nullptr;
      else norm = &(*list)[0];
    }
    if (norm != nullptr) {
      const std::string type = norm->is_object() ? norm->value("type", "") : "";
      if (type != "NFC") return Unsupported(absl::StrCat("normalizer '", type, "' (only NFC or none)"));
      tok->nfc_ = true;
    }
  }

  // Pre-tokenizer: must end in ByteLevel (the model's vocabulary is byte-level).
  auto pre = j.find("pre_tokenizer");
  if (pre == j.end() || pre->is_null()) return Unsupported("tokenizer without a pre_tokenizer (not byte-level)");
  if (absl::Status s = ParsePreTokenizer(*pre, tok->pre_tokenizer_); !s.ok()) return s;
  int byte_level_steps = 0;
  for (const PreTokenizerStep& step : tok->pre_tokenizer_) byte_level_steps += step.kind == PreTokenizerStep::Kind::kByteLevel;
  if (byte_level_steps != 1 || tok->pre_tokenizer_.back().kind != PreTokenizerStep::Kind::kByteLevel) {
    return Unsupported("pre_tokenizer (needs exactly one ByteLevel step, last)");
  }

  // Decoder: ByteLevel (or absent).
  if (auto d = j.find("decoder"); d != j.end() && !d->is_null()) {
    const std::string type = d->is_object() ? d->value("type", "") : "";
    if (type != "ByteLevel") return Unsupported(absl::StrCat("decoder '", type, "' (only ByteLevel)"));
  }
  // Post-processor: only applies with add_special_tokens=True, which Encode never does.
  if (auto pp = j.find("post_processor"); pp != j.end() && !pp->is_null()) {
    const std::string type = pp->is_object() ? pp->value("type", "") : "";
    if (type != "ByteLevel" && type != "TemplateProcessing" && type != "Sequence") {
      return Unsupported(absl::StrCat("post_processor '", type, "'"));
    }
  }

  // Model: BPE.
  auto m = j.find("model");
  if (m == j.end() || !m->is_object()) return Unsupported("tokenizer.json without a model");
  const std::string model_type = m->value("type", "BPE");
  if (model_type != "BPE") return Unsupported(absl::StrCat("model type '", model_type, "' (only BPE)"));
  if (auto v = m->find("dropout"); v != m->end() && !v->is_null()) return Unsupported("BPE dropout");
  if (auto v = m->find("unk_token"); v != m->end() && !v->is_null()) return Unsupported("BPE unk_token (byte-level BPE has none)");
  if (auto v = m->find("byte_fallback"); v != m->end() && v->is_boolean() && v->get<bool>()) return Unsupported("BPE byte_fallback=true");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (auto v = m->find(key); v != m->end() && !v->is_null() && !(v->is_string() && v->get<std::string>().empty())) {
      return Unsupported(absl::StrCat("BPE ", key));
    }
  }
  tok->ignore_merges_ = m->value("ignore_merges", false);
  auto vocab = m->find("vocab");
  if (vocab == m->end() || !vocab->is_object()) return absl::InvalidArgumentError("tokenizer.json: model.vocab is not an object");
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxVocabSize) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json: model.vocab['", token, "'] is not an id in [0, ", kMaxVocabSize, ")"));
    }
    tok->vocab_[token] = static_cast<int32_t>(id.get<int64_t>());
    max_id = std::max(max_id, id.get<int64_t>());
  }
  auto merges = m->find("merges");
  if (merges == m->end() || !merges->is_array()) return absl::InvalidArgumentError("tokenizer.json: model.merges is not an array");
  int32_t rank = 0;
  for (const Json& merge : *merges) {
    std::string a, b;
    if (merge.is_string()) {
      const std::string s = merge.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: merge '", s, "' is not 'a b'"));
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      a = merge[0].get<std::string>();
      b = merge[1].get<std::string>();
    } else {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: merge ", rank, " is neither 'a b' nor [a, b]"));
    }
    auto ia = tok->vocab_.find(a), ib = tok->vocab_.find(b), iab = tok->vocab_.find(a + b);
    if (ia == tok->vocab_.end() || ib == tok->vocab_.end() || iab == tok->vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: merge ", rank, " ('", a, "', '", b, "') uses a token not in the vocabulary"));
    }
    tok->merges_[{ia->second, ib->second}] = {rank, iab->second};
    ++rank;
  }

  // Added tokens.
  if (auto added = j.find("added_tokens"); added != j.end() && !added->is_null()) {
    if (!added->is_array()) return absl::InvalidArgumentError("tokenizer.json: added_tokens is not an array");
    for (const Json& t : *added) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
          !t["content"].is_string()) {
        return absl::InvalidArgumentError("tokenizer.json: an added token without an integer id and a string content");
      }
      AddedToken a;
      const int64_t id = t["id"].get<int64_t>();
      if (id < 0 || id >= kMaxVocabSize) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer.json: added token id ", id, " is not in [0, ", kMaxVocabSize, ")"));
      }
      a.id = static_cast<int32_t>(id);
      a.content = t["content"].get<std::string>();
      if (!utf8::IsValid(a.content) || a.content.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: added token ", id, " has empty or invalid UTF-8 content"));
      }
      a.special = t.value("special", false);
      a.lstrip = t.value("lstrip", false);
      a.rstrip = t.value("rstrip", false);
      a.normalized = t.value("normalized", !a.special);
      a.single_word = t.value("single_word", false);
      max_id = std::max(max_id, id);
      const size_t index = tok->added_.size();
      tok->added_by_content_[a.content] = index;
      tok->added_by_id_[a.id] = index;
      tok->added_.push_back(std::move(a));
    }
  }
  for (size_t i = 0; i < tok->added_.size(); ++i) {
    const AddedToken& a = tok->added_[i];
    if (!a.normalized) {
      tok->raw_matcher_.Add(a.content, i);
    } else {
      absl::StatusOr<std::string> normalized = tok->nfc_ ? Nfc(a.content) : absl::StatusOr<std::string>(a.content);
      if (!normalized.ok()) return normalized.status();
      tok->normalized_matcher_.Add(*normalized, i);
    }
  }

  tok->bytes_.assign(static_cast<size_t>(max_id + 1), std::string());
  tok->known_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [token, id] : tok->vocab_) {
    tok->bytes_[id] = FromByteLevel(token);
    tok->known_[id] = true;
  }
  for (const AddedToken& a : tok->added_) {
    tok->bytes_[a.id] = FromByteLevel(a.content);
    tok->known_[a.id] = true;
  }
  return tok;
}

// Splits `text` around the added tokens `matcher` finds, as HF's AddedVocabulary::find_matches
// does: leftmost-longest, single_word checked on the neighbours, lstrip/rstrip swallowing the
// whitespace beside a match.
absl::Status BpeTokenizer::SplitAdded(std::string_view text, const AddedMatcher& matcher, std::vector<Piece>& out) const {
  if (matcher.empty()) {
    out.push_back(Piece{std::string(text), -1});
    return absl::OkStatus();
  }
  size_t emitted = 0;  // text before this is in `out`
  size_t pos = 0;
  while (pos < text.size()) {
    const auto [index, length] = matcher.LongestAt(text, pos);
    if (index < 0) {
      pos += utf8::SequenceLength(static_cast<unsigned char>(text[pos]));
      continue;
    }
    const AddedToken& token = added_[index];
    size_t start = pos, stop = pos + length;
    pos = stop;
    if (token.single_word) {
      bool word_before = false, word_after = false;
      if (start > 0) {
        size_t i = start - 1;
        while (i > 0 && utf8::IsContinuation(static_cast<unsigned char>(text[i]))) --i;
        size_t j = i;
        word_before = IsWordChar(utf8::DecodeAt(text, j));
      }
      if (stop < text.size()) {
        size_t j = stop;
        word_after = IsWordChar(utf8::DecodeAt(text, j));
      }
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      while (start > emitted) {
        size_t i = start - 1;
        while (i > emitted && utf8::IsContinuation(static_cast<unsigned char>(text[i]))) --i;
        size_t j = i;
        if (!IsWhitespace(utf8::DecodeAt(text, j))) break;
        start = i;
      }
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t j = stop;
        if (!IsWhitespace(utf8::DecodeAt(text, j))) break;
        stop = j;
      }
      pos = stop;
    }
    if (start > emitted) out.push_back(Piece{std::string(text.substr(emitted, start - emitted)), -1});
    out.push_back(Piece{std::string(), token.id});
    emitted = stop;
  }
  if (emitted < text.size()) out.push_back(Piece{std::string(text.substr(emitted)), -1});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text) const {
  if (size_t bad = utf8::FirstInvalid(text); bad != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("text is not valid UTF-8 (byte ", bad, ")"));
  }
  std::vector<Piece> pieces;
  if (absl::Status s = SplitAdded(text, raw_matcher_, pieces); !s.ok()) return s;
  std::vector<int32_t> ids;
  for (Piece& piece : pieces) {
    if (piece.added_id >= 0) {
      ids.push_back(piece.added_id);
      continue;
    }
    if (piece.text.empty()) continue;
    std::string normalized = std::move(piece.text);
    if (nfc_) {
      absl::StatusOr<std::string> n = Nfc(normalized);
      if (!n.ok()) return n.status();
      normalized = *std::move(n);
    }
    std::vector<Piece> inner;
    if (absl::Status s = SplitAdded(normalized, normalized_matcher_, inner); !s.ok()) return s;
    for (const Piece& p : inner) {
      if (p.added_id >= 0) {
        ids.push_back(p.added_id);
      } else if (absl::Status s = EncodeText(p.text, ids); !s.ok()) {
        return s;
      }
    }
  }
  return ids;
}

// Pre-tokenizes `text` (normalized, no added tokens in it) and runs BPE on every word.
absl::Status BpeTokenizer::EncodeText(std::string_view text, std::vector<int32_t>& ids) const {
  if (text.empty()) return absl::OkStatus();
  std::vector<std::string> words{std::string(text)};
  std::vector<std::pair<size_t, size_t>> matches;
  for (const PreTokenizerStep& step : pre_tokenizer_) {
    std::vector<std::string> next;
    for (std::string& word : words) {
      if (step.kind == PreTokenizerStep::Kind::kByteLevel && step.add_prefix_space && word[0] != ' ') {
        word.insert(word.begin(), ' ');
      }
      if (!step.regex) {
        next.push_back(std::move(word));
        continue;
      }
      matches.clear();
      if (absl::Status s = step.regex->FindAll(word, matches); !s.ok()) return s;
      // Isolated: every match is a piece, and so is every gap between matches.
      size_t at = 0;
      for (const auto& [begin, end] : matches) {
        if (begin > at) next.push_back(word.substr(at, begin - at));
        next.push_back(word.substr(begin, end - begin));
        at = end;
      }
      if (at < word.size()) next.push_back(word.substr(at));
    }
    words = std::move(next);
  }
  for (const std::string& word : words) Bpe(ToByteLevel(word), ids);
  return absl::OkStatus();
}

// BPE on one byte-level word: merges applied lowest rank first (leftmost among equal ranks),
// through a priority queue over a linked list of symbols, as HF's Word::merge_all does.
void BpeTokenizer::Bpe(const std::string& word, std::vector<int32_t>& ids) const {
  if (ignore_merges_) {
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  if (cacheable) {
    absl::MutexLock lock(&cache_mu_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (size_t i = 0; i < word.size();) {
    const size_t n = utf8::SequenceLength(static_cast<unsigned char>(word[i]));
    auto it = vocab_.find(absl::string_view(word).substr(i, n));
    i += n;
    if (it == vocab_.end()) continue;  // no unk token: HF drops the character
    const int index = static_cast<int>(symbols.size());
    symbols.push_back(Symbol{it->second, index - 1, index + 1, true});
  }
  if (!symbols.empty()) symbols.back().next = -1;

  struct Merge {
    int32_t rank;
    int pos;
    int32_t new_id;
    bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Merge, std::vector<Merge>, std::greater<>> queue;
  auto pair_merge = [this](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
    auto it = merges_.find({a, b});
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const auto* m = pair_merge(symbols[i].id, symbols[i + 1].id)) queue.push(Merge{m->first, static_cast<int>(i), m->second});
  }
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const auto* m = pair_merge(left.id, right.id);
    if (m == nullptr || m->second != top.new_id) continue;
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) {
      if (const auto* p = pair_merge(symbols[left.prev].id, left.id)) queue.push(Merge{p->first, left.prev, p->second});
    }
    if (left.next >= 0) {
      if (const auto* n = pair_merge(left.id, symbols[left.next].id)) queue.push(Merge{n->first, top.pos, n->second});
    }
  }
  std::vector<int32_t> result;
  for (const Symbol& s : symbols) {
    if (s.alive) result.push_back(s.id);
  }
  ids.insert(ids.end(), result.begin(), result.end());
  if (cacheable) {
    absl::MutexLock lock(&cache_mu_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(word, std::move(result));
  }
}

absl::StatusOr<std::string> BpeTokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= known_.size() || !known_[id]) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is not in the vocabulary (size ", bytes_.size(), ")"));
    }
    if (skip_special_tokens && IsSpecial(id)) continue;
    bytes += bytes_[id];
  }
  return utf8::Repair(bytes);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view tokenizer_json) {
  Json j = Json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("tokenizer.json: not a JSON object");
  return BpeTokenizer::Build(j);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromModelDir(const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no tokenizer at ", path));
  std::stringstream contents;
  contents << in.rdbuf();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = FromJson(contents.str());
  if (!tok.ok()) return absl::Status(tok.status().code(), absl::StrCat(path, ": ", tok.status().message()));
  return tok;
}

// ---- StreamDecoder ---------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamDecoder::Push(int32_t id) {
  if (skip_special_tokens_ && tokenizer_.IsSpecial(id)) return "";
  pending_ += tokenizer_.TokenBytes(id);
  const size_t complete = utf8::CompletePrefix(pending_);
  std::string out = utf8::Repair(std::string_view(pending_).substr(0, complete));
  pending_.erase(0, complete);
  return out;
}

std::string StreamDecoder::Finish() {
  std::string out = utf8::Repair(pending_);
  pending_.clear();
  return out;
}

}  // namespace twinkle::tokenizer
