// The option table: DKFAC_OPTIONS (options.h) as data, and options set and read by name.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>

#include <c10/util/Exception.h>

#include "dkfac/options.h"

namespace dkfac {
namespace {

// --- what each C++ type of an option is, as the front ends see it --------------------------------------

template <typename E>
struct Choices;  // the names of an enum option's values, in the order messages list them
template <>
struct Choices<ComputeMethod> {
  static std::vector<std::pair<std::string, ComputeMethod>> all() {
    return {{"eigen", ComputeMethod::kEigen}, {"inverse", ComputeMethod::kInverse}};
  }
};
template <>
struct Choices<UnusedLayerPolicy> {
  static std::vector<std::pair<std::string, UnusedLayerPolicy>> all() {
    return {{"error", UnusedLayerPolicy::kError}, {"skip", UnusedLayerPolicy::kSkip}};
  }
};
template <>
struct Choices<KfacApprox> {
  static std::vector<std::pair<std::string, KfacApprox>> all() {
    return {{"expand", KfacApprox::kExpand}, {"reduce", KfacApprox::kReduce}};
  }
};
template <>
struct Choices<PreconditionDtype> {
  static std::vector<std::pair<std::string, PreconditionDtype>> all() {
    return {{"float32", PreconditionDtype::kFloat32}, {"tf32", PreconditionDtype::kTf32}};
  }
};
template <>
struct Choices<StrategyOption> {
  static std::vector<std::pair<std::string, StrategyOption>> all() {
    return {{"kaisa", Strategy::kKaisa}, {"spd", Strategy::kSpd}, {"dp", Strategy::kDp}, {"auto", kStrategyAuto}};
  }
};
template <>
struct Choices<ShardedPlacement> {
  static std::vector<std::pair<std::string, ShardedPlacement>> all() {
    return {{"replicated", ShardedPlacement::kReplicated}, {"owner", ShardedPlacement::kOwner}};
  }
};
template <>
struct Choices<assign::Balance> {
  static std::vector<std::pair<std::string, assign::Balance>> all() {
    return {{"compute", assign::Balance::kCompute}, {"memory", assign::Balance::kMemory}};
  }
};
using Dtype = std::optional<c10::ScalarType>;
// An option whose value is one of the names Choices<T> lists.
template <typename T>
constexpr bool is_choice_v = std::is_enum_v<T> || std::is_same_v<T, StrategyOption>;
const std::vector<std::pair<std::string, c10::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, c10::ScalarType>> all = {
      {"float32", c10::kFloat}, {"float64", c10::kDouble}, {"bfloat16", c10::kBFloat16}, {"float16", c10::kHalf}};
  return all;
}

template <typename T>
constexpr OptionType type_of() {
  if constexpr (std::is_same_v<T, bool>) return OptionType::kBool;
  if constexpr (std::is_same_v<T, int64_t>) return OptionType::kInt;
  if constexpr (std::is_same_v<T, double>) return OptionType::kDouble;
  if constexpr (std::is_same_v<T, Dtype>) return OptionType::kDtype;
  if constexpr (std::is_same_v<T, std::vector<std::string>>) return OptionType::kStrings;
  if constexpr (std::is_same_v<T, std::vector<int64_t>>) return OptionType::kInts;
  if constexpr (is_choice_v<T>) return OptionType::kChoice;
}

template <typename T>
std::vector<std::string> choice_names() {
  std::vector<std::string> names;
  if constexpr (is_choice_v<T>) {
    for (const auto& [name, value] : Choices<T>::all()) names.push_back(name);
  } else if constexpr (std::is_same_v<T, Dtype>) {
    for (const auto& [name, value] : dtype_names()) names.push_back(name);
  }
  return names;
}

std::string joined(const std::vector<std::string>& names, const std::string& separator = ", ") {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : separator) + n;
  return out;
}

std::string number_text(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// What a value given to an option was, for messages.
std::string given(const OptionValue& value) {
  return std::visit(
      [](const auto& v) -> std::string {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, std::monostate>) return "none";
        if constexpr (std::is_same_v<V, bool>) return v ? "true" : "false";
        if constexpr (std::is_same_v<V, int64_t>) return std::to_string(v);
        if constexpr (std::is_same_v<V, double>) return number_text(v);
        if constexpr (std::is_same_v<V, std::string>) return "'" + v + "'";
        if constexpr (std::is_same_v<V, std::vector<std::string>>) return "[" + joined(v) + "]";
        if constexpr (std::is_same_v<V, std::vector<int64_t>>) {
          std::vector<std::string> parts;
          for (auto x : v) parts.push_back(std::to_string(x));
          return "[" + joined(parts) + "]";
        }
        if constexpr (std::is_same_v<V, std::function<double(int64_t)>>) return "a function";
        return "?";
      },
      value);
}

// The number in `value` (an integer, a number, or one of the range's names); throws naming `shown` otherwise.
double number_in(const OptionValue& value, const OptionRange& range, const std::string& shown, bool integer) {
  double v = 0;
  if (const auto* i = std::get_if<int64_t>(&value)) {
    v = static_cast<double>(*i);
  } else if (const auto* d = std::get_if<double>(&value)) {
    v = *d;
  } else if (std::holds_alternative<std::string>(value) || std::holds_alternative<std::monostate>(value)) {
    std::string key = std::holds_alternative<std::string>(value) ? std::get<std::string>(value) : "none";
    char* end = nullptr;
    const double parsed = std::strtod(key.c_str(), &end);
    if (!key.empty() && end == key.c_str() + key.size()) return number_in(parsed, range, shown, integer);
    std::replace(key.begin(), key.end(), '_', '-');
    std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) { return std::tolower(c); });
    const auto it = std::find_if(range.named.begin(), range.named.end(), [&key](const auto& n) { return n.first == key; });
    std::vector<std::string> names;
    for (const auto& n : range.named) names.push_back(n.first);
    TORCH_CHECK(it != range.named.end(), shown, " must be ", integer ? "an integer" : "a number",
                names.empty() ? "" : " or one of " + joined(names), ", got ", given(value));
    return it->second;
  } else {
    TORCH_CHECK(false, shown, " must be ", integer ? "an integer" : "a number", ", got ", given(value));
  }
  TORCH_CHECK(!integer || v == std::floor(v), shown, " must be an integer, got ", given(value));
  TORCH_CHECK(std::isfinite(v) && range.contains(v), shown, " must be ", integer ? "" : "finite and ",
              range.describe(), ", got ", given(value));
  return v;
}

// A whole number `v` (checked) as int64_t: refused outside int64's range (9.2e18), where the cast is undefined (it
// gave INT64_MIN).
int64_t as_int64(double v, const std::string& shown, const std::string& at = "") {
  constexpr double kLimit = 9223372036854775808.0;  // 2^63
  TORCH_CHECK(std::isfinite(v) && v >= -kLimit && v < kLimit, shown, " must be an integer of at most 2^63 - 1 in "
              "size, got ", v, at);
  return static_cast<int64_t>(v);
}

// `value` converted to the option's C++ type `T`, checked against its declaration.
template <typename T>
T convert(const OptionValue& value, const OptionRange& range, const std::string& shown) {
  if constexpr (std::is_same_v<T, bool>) {
    const auto* b = std::get_if<bool>(&value);
    TORCH_CHECK(b != nullptr, shown, " must be true or false, got ", given(value));
    return *b;
  } else if constexpr (std::is_same_v<T, int64_t>) {
    TORCH_CHECK(!std::holds_alternative<bool>(value), shown, " must be an integer, got ", given(value));
    const double v = number_in(value, range, shown, true);
    if (const auto* exact = std::get_if<int64_t>(&value)) return *exact;  // as given: past 2^53 a double rounds
    return as_int64(v, shown);
  } else if constexpr (std::is_same_v<T, double>) {
    TORCH_CHECK(!std::holds_alternative<bool>(value), shown, " must be a number, got ", given(value));
    return number_in(value, range, shown, false);
  } else if constexpr (is_choice_v<T>) {
    const auto* name = std::get_if<std::string>(&value);
    if (name != nullptr) {
      for (const auto& [n, v] : Choices<T>::all()) {
        if (n == *name) return v;
      }
    }
    TORCH_CHECK(false, shown, " must be one of ", joined(choice_names<T>()), ", got ", given(value));
  } else if constexpr (std::is_same_v<T, Dtype>) {
    if (std::holds_alternative<std::monostate>(value)) return std::nullopt;
    const auto* name = std::get_if<std::string>(&value);
    if (name != nullptr) {
      if (const auto dtype = storage_dtype_named(*name)) return dtype;
    }
    TORCH_CHECK(false, shown, " must be one of ", joined(choice_names<T>()), " or none (the default), got ",
                given(value));
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    if (const auto* one = std::get_if<std::string>(&value)) return {*one};
    if (std::holds_alternative<std::monostate>(value)) return {};
    const auto* all = std::get_if<std::vector<std::string>>(&value);
    TORCH_CHECK(all != nullptr, shown, " must be a list of strings, got ", given(value));
    return *all;
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    if (std::holds_alternative<std::monostate>(value)) return {};
    if (const auto* none = std::get_if<std::vector<std::string>>(&value); none && none->empty()) return {};
    const auto* all = std::get_if<std::vector<int64_t>>(&value);
    TORCH_CHECK(all != nullptr, shown, " must be a list of integers, got ", given(value));
    for (int64_t v : *all) {
      TORCH_CHECK(range.contains(static_cast<double>(v)), shown, " entries must be ", range.describe(), ", got ", v);
    }
    return *all;
  }
}

// A value of the option's C++ type as an OptionValue.
template <typename T>
OptionValue value_of(const T& v) {
  if constexpr (is_choice_v<T>) {
    for (const auto& [n, e] : Choices<T>::all()) {
      if (e == v) return n;
    }
    return std::string("unknown");
  } else if constexpr (std::is_same_v<T, Dtype>) {
    if (!v) return std::monostate();
    return storage_dtype_name(*v);
  } else {
    return v;
  }
}
template <typename T>
OptionValue value_of(const Schedule<T>& schedule) {
  if (!schedule.is_constant()) return std::string("(a function of the step)");
  return value_of(schedule(0));
}

// A function of the step for a schedule of T; an integer schedule checks that the function's values are whole.
template <typename T>
Schedule<T> schedule_from(const OptionValue& value, const OptionRange& range, const std::string& shown) {
  if (const auto* fn = std::get_if<std::function<double(int64_t)>>(&value)) {
    if constexpr (std::is_same_v<T, int64_t>) {
      return Schedule<T>(std::function<int64_t(int64_t)>([fn = *fn, shown](int64_t step) {
        const double v = fn(step);
        TORCH_CHECK(v == std::floor(v), shown, " must be an integer, got ", v, " at step ", step);
        return as_int64(v, shown, " at step " + std::to_string(step));
      }));
    } else {
      return Schedule<T>(*fn);
    }
  }
  return Schedule<T>(convert<T>(value, range, shown));
}

// How an option is read and written by name.
struct Access {
  std::function<OptionValue(const Options&)> get;
  std::function<void(Options&, const OptionValue&, const std::string& shown)> set;
};

struct Table {
  std::vector<OptionInfo> infos;
  std::map<std::string, Access> access;  // by name
  std::map<std::string, std::string> by_alias;
};

template <typename T>
OptionInfo info_of(std::string name, bool schedule, OptionRange range, std::string flag, std::string alias,
                   std::string kfac_pytorch_default, std::string doc) {
  OptionInfo info;
  info.name = std::move(name);
  info.type = type_of<T>();
  info.schedule = schedule;
  info.range = std::move(range);
  info.choices = choice_names<T>();
  info.flag = std::move(flag);
  info.alias = std::move(alias);
  info.kfac_pytorch_default = std::move(kfac_pytorch_default);
  info.doc = std::move(doc);
  return info;
}

#define DKFAC_IS_SCHEDULE_Schedule true
#define DKFAC_IS_SCHEDULE_Value false
#define DKFAC_SET_Schedule(T, range, shown, value) schedule_from<T>(value, range, shown)
#define DKFAC_SET_Value(T, range, shown, value) convert<T>(value, range, shown)

const Table& table() {
  static const Table t = [] {
    Table t;
#define DKFAC_OPTION_ENTRY(kind, T, name, default_value, range, flag, alias, pt_default, doc)                   \
  t.infos.push_back(info_of<T>(#name, DKFAC_IS_SCHEDULE_##kind, range, flag, alias, pt_default, doc));          \
  t.access[#name] = Access{[](const Options& o) { return value_of(o.name()); },                                 \
                           [](Options& o, const OptionValue& v, const std::string& shown) {                    \
                             o.name(DKFAC_SET_##kind(T, range, shown, v));                                     \
                           }};
#define DKFAC_SPD_OPTION_ENTRY(kind, T, name, default_value, range, flag, alias, pt_default, doc)               \
  t.infos.push_back(info_of<T>("spd_" #name, DKFAC_IS_SCHEDULE_##kind, range, flag, alias, pt_default, doc));   \
  t.access["spd_" #name] = Access{[](const Options& o) { return value_of(o.spd().name()); },                    \
                                  [](Options& o, const OptionValue& v, const std::string& shown) {             \
                                    o.spd(SpdOptions(o.spd()).name(DKFAC_SET_##kind(T, range, shown, v)));    \
                                  }};
    DKFAC_OPTIONS(DKFAC_OPTION_ENTRY)
    DKFAC_SPD_OPTIONS(DKFAC_SPD_OPTION_ENTRY)
#undef DKFAC_OPTION_ENTRY
#undef DKFAC_SPD_OPTION_ENTRY
    const Options defaults;
    for (auto& info : t.infos) {
      info.default_text = option_text(info, t.access.at(info.name).get(defaults));
      if (!info.alias.empty()) t.by_alias[info.alias] = info.name;
    }
    return t;
  }();
  return t;
}

#undef DKFAC_IS_SCHEDULE_Schedule
#undef DKFAC_IS_SCHEDULE_Value
#undef DKFAC_SET_Schedule
#undef DKFAC_SET_Value

const std::string& canonical_name(const std::string& name) {
  const auto& t = table();
  if (t.access.count(name) > 0) return name;
  const auto alias = t.by_alias.find(name);
  if (alias != t.by_alias.end()) return alias->second;
  std::vector<std::string> names;
  for (const auto& info : t.infos) names.push_back(info.name);
  TORCH_CHECK(false, "unknown option '", name, "'; the options are: ", joined(names));
}

}  // namespace

std::string OptionRange::describe() const {
  const bool low = min > -1e308;
  const bool high = max < 1e308;
  if (low && high) {
    return std::string("in ") + (min_open ? "(" : "[") + number_text(min) + ", " + number_text(max) +
           (max_open ? ")" : "]");
  }
  if (low) return std::string(min_open ? "> " : ">= ") + number_text(min);
  if (high) return std::string(max_open ? "< " : "<= ") + number_text(max);
  return "a number";
}

bool OptionRange::contains(double value) const {
  return (min_open ? value > min : value >= min) && (max_open ? value < max : value <= max);
}

const std::vector<OptionInfo>& option_table() { return table().infos; }

const OptionInfo& option_info(const std::string& name) {
  const auto& canonical = canonical_name(name);
  const auto& infos = table().infos;
  return *std::find_if(infos.begin(), infos.end(), [&canonical](const OptionInfo& i) { return i.name == canonical; });
}

std::string option_text(const OptionInfo& info, const OptionValue& value) {
  if (const auto* s = std::get_if<std::string>(&value)) return *s;
  if (info.type == OptionType::kBool) return std::get<bool>(value) ? "true" : "false";
  return given(value);
}

Options& Options::set(const std::string& name, const OptionValue& value, const std::string& shown_as) {
  const auto& canonical = canonical_name(name);
  table().access.at(canonical).set(*this, value, shown_as.empty() ? name : shown_as);
  return *this;
}

OptionValue Options::get(const std::string& name) const { return table().access.at(canonical_name(name)).get(*this); }

std::string Options::describe() const {
  std::string out;
  for (const auto& info : table().infos) {
    out += (out.empty() ? "" : ", ") + info.name + "=" + option_text(info, get(info.name));
  }
  return out;
}

std::string storage_dtype_name(c10::ScalarType dtype) {
  for (const auto& [name, d] : dtype_names()) {
    if (d == dtype) return name;
  }
  return c10::toString(dtype);
}

std::optional<c10::ScalarType> storage_dtype_named(const std::string& name) {
  for (const auto& [n, d] : dtype_names()) {
    if (n == name) return d;
  }
  return std::nullopt;
}

const char* to_string(assign::Balance balance) {
  return balance == assign::Balance::kMemory ? "memory" : "compute";
}

const char* to_string(UnusedLayerPolicy policy) { return policy == UnusedLayerPolicy::kSkip ? "skip" : "error"; }

const char* to_string(ShardedPlacement placement) {
  return placement == ShardedPlacement::kOwner ? "owner" : "replicated";
}

const char* to_string(KfacApprox approx) { return approx == KfacApprox::kReduce ? "reduce" : "expand"; }

}  // namespace dkfac
