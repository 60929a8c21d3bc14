// Parsing of the one KDA options object (kda_problem.h). The text is produced by
// kernel_fun.kda._options.KdaOptions.encode(): "scale=<float>;gate=<mode>;lower_bound=<float>;
// l2norm=<0|1>;beta_sigmoid=<0|1|2>;state_v_first=<0|1>;chunk_size=<int>;split=<0|1|2>;
// split_chunks=<int >= 0>;recurrent=<-1|0|1>;intermediate_states=<0|1>;max_seq_len=<int >= 0>", floats as C99 hex
// floats (exact round trip). Strict: every key exactly once, nothing else.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

#include "kda/kda_problem.h"

namespace kernel_fun::kda {

namespace {

bool to_float(const std::string& v, float& out) {
  if (v.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (errno != 0 || end != v.c_str() + v.size() || !std::isfinite(d)) return false;
  out = static_cast<float>(d);
  return true;
}

bool to_int(const std::string& v, long& out) {
  if (v.empty()) return false;
  errno = 0;
  char* end = nullptr;
  out = std::strtol(v.c_str(), &end, 10);
  return errno == 0 && end == v.c_str() + v.size();
}

}  // namespace

std::string parse_options(const std::string& text, KdaOptions& out) {
  enum Key { kScale, kGate, kLower, kL2, kBeta, kSvf, kChunk_, kSplit, kSplitChunks, kRecurrent, kStates,
             kMaxSeqLen, kNumKeys };
  static const char* const names[kNumKeys] = {"scale",      "gate",         "lower_bound",   "l2norm",
                                              "beta_sigmoid", "state_v_first", "chunk_size", "split",
                                              "split_chunks", "recurrent",    "intermediate_states",
                                              "max_seq_len"};
  bool seen[kNumKeys] = {};
  KdaOptions o;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t semi = text.find(';', pos);
    const std::string item = text.substr(pos, semi == std::string::npos ? std::string::npos : semi - pos);
    pos = semi == std::string::npos ? text.size() + 1 : semi + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) return "options: '" + item + "' is not key=value";
    const std::string key = item.substr(0, eq), val = item.substr(eq + 1);
    int k = -1;
    for (int i = 0; i < kNumKeys; ++i)
      if (key == names[i]) k = i;
    if (k < 0) return "options: unknown key '" + key + "'";
    if (seen[k]) return "options: key '" + key + "' given twice";
    seen[k] = true;
    long iv = 0;
    bool ok = true;
    switch (k) {
      case kScale: ok = to_float(val, o.scale); break;
      case kLower: ok = to_float(val, o.lower_bound); break;
      case kGate:
        if (val == "precomputed") o.gate_mode = GateMode::kPrecomputed;
        else if (val == "unbounded") o.gate_mode = GateMode::kUnbounded;
        else if (val == "bounded") o.gate_mode = GateMode::kBounded;
        else if (val == "bounded_no_alog") o.gate_mode = GateMode::kBoundedNoALog;
        else ok = false;
        break;
      case kL2: ok = to_int(val, iv) && (iv == 0 || iv == 1); o.l2norm = iv == 1; break;
      case kBeta: ok = to_int(val, iv) && iv >= 0 && iv <= 2; o.beta_sigmoid_scale = static_cast<float>(iv); break;
      case kSvf: ok = to_int(val, iv) && (iv == 0 || iv == 1); o.state_v_first = iv == 1; break;
      case kChunk_: ok = to_int(val, iv) && (iv == 32 || iv == 64); o.chunk_size = static_cast<int>(iv); break;
      case kSplit: ok = to_int(val, iv) && iv >= 0 && iv <= 2; o.split = static_cast<int>(iv); break;
      case kSplitChunks:
        ok = to_int(val, iv) && iv >= 0 && iv <= (1L << 30);
        o.split_chunks = static_cast<int>(iv);
        break;
      case kRecurrent: ok = to_int(val, iv) && iv >= -1 && iv <= 1; o.recurrent = static_cast<int>(iv); break;
      case kStates: ok = to_int(val, iv) && (iv == 0 || iv == 1); o.intermediate_states = iv == 1; break;
      case kMaxSeqLen:
        ok = to_int(val, iv) && iv >= 0 && iv <= (1L << 30);
        o.max_seq_len = static_cast<int>(iv);
        break;
    }
    if (!ok) return "options: bad value '" + val + "' for '" + key + "'";
  }
  for (int i = 0; i < kNumKeys; ++i)
    if (!seen[i]) return std::string("options: missing key '") + names[i] + "'";
  out = o;
  return "";
}

}  // namespace kernel_fun::kda
