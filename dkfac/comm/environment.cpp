#include "dkfac/comm/environment.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>

namespace dkfac::comm {

namespace {

using Lookup = std::function<std::optional<std::string>(const std::string&)>;

// A whole-string decimal integer, or an error naming the variable and its value.
long long integer(const Lookup& lookup, const std::string& name) {
  const auto value = lookup(name);
  TORCH_CHECK(value.has_value(), "environment variable ", name, " is not set");
  const std::string& text = *value;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(!text.empty() && end == text.c_str() + text.size() && errno == 0 && !std::isspace(text.front()),
              "environment variable ", name, "='", text, "' is not an integer");
  return parsed;
}

int bounded(const Lookup& lookup, const std::string& name, long long low, long long high) {
  const long long v = integer(lookup, name);
  TORCH_CHECK(v >= low && v <= high, "environment variable ", name, "=", v, " is outside ", low, "..", high);
  return static_cast<int>(v);
}

std::optional<int> optional_bounded(const Lookup& lookup, const std::string& name, long long low, long long high) {
  if (!lookup(name)) return std::nullopt;
  return bounded(lookup, name, low, high);
}

constexpr long long kMaxRanks = 1 << 20;

}  // namespace

std::string to_string(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone:
      return "single process";
    case Launcher::kTorchElastic:
      return "torch elastic agent";
    case Launcher::kEnv:
      return "RANK/WORLD_SIZE";
    case Launcher::kMpi:
      return "mpirun";
    case Launcher::kSlurm:
      return "Slurm";
  }
  return "unknown";
}

std::vector<std::string> expand_slurm_hostlist(const std::string& list) {
  // Split at top-level commas (commas inside brackets separate ranges).
  std::vector<std::string> names;
  int depth = 0;
  std::string current;
  for (char c : list) {
    TORCH_CHECK(depth >= 0, "malformed Slurm host list '", list, "': unmatched ']'");
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      if (!current.empty()) names.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  TORCH_CHECK(depth == 0, "malformed Slurm host list '", list, "': unmatched '", depth > 0 ? "[" : "]", "'");
  if (!current.empty()) names.push_back(current);

  std::vector<std::string> hosts;
  for (const auto& name : names) {
    // Expand the first bracket group, then the rest of the name recursively.
    const auto open = name.find('[');
    if (open == std::string::npos) {
      hosts.push_back(name);
      continue;
    }
    const auto close = name.find(']', open);
    const std::string head = name.substr(0, open);
    const std::string body = name.substr(open + 1, close - open - 1);
    const std::string tail = name.substr(close + 1);
    const auto rest = tail.empty() ? std::vector<std::string>{""} : expand_slurm_hostlist(tail);
    std::stringstream ranges(body);
    std::string range;
    while (std::getline(ranges, range, ',')) {
      const auto dash = range.find('-');
      const std::string first = range.substr(0, dash);
      const std::string last = dash == std::string::npos ? first : range.substr(dash + 1);
      const auto digits = [&](const std::string& s) {
        TORCH_CHECK(!s.empty() && s.find_first_not_of("0123456789") == std::string::npos, "malformed Slurm host list '",
                    list, "': '", range, "' is not a number or a range of numbers");
        return std::stoll(s);
      };
      const long long from = digits(first), to = digits(last);
      TORCH_CHECK(from <= to && to - from < kMaxRanks, "malformed Slurm host list '", list, "': range '", range, "'");
      for (long long n = from; n <= to; ++n) {
        std::string number = std::to_string(n);
        if (number.size() < first.size()) number.insert(0, first.size() - number.size(), '0');
        for (const auto& r : rest) hosts.push_back(head + number + r);
      }
    }
  }
  return hosts;
}

int slurm_port(long long job_id) { return 20000 + static_cast<int>(job_id % 10000); }

JobEnvironment read_job_environment(const Lookup& lookup) {
  JobEnvironment job;
  const bool torch_env = lookup("RANK") && lookup("WORLD_SIZE");
  if (torch_env) {
    job.launcher = lookup("TORCHELASTIC_RUN_ID") || lookup("TORCHELASTIC_RESTART_COUNT") ? Launcher::kTorchElastic
                                                                                         : Launcher::kEnv;
    job.world_size = bounded(lookup, "WORLD_SIZE", 1, kMaxRanks);
    job.rank = bounded(lookup, "RANK", 0, job.world_size - 1);
    job.local_rank = optional_bounded(lookup, "LOCAL_RANK", 0, kMaxRanks).value_or(job.rank);
    job.local_world_size = optional_bounded(lookup, "LOCAL_WORLD_SIZE", 1, kMaxRanks).value_or(job.world_size);
    job.node_rank = optional_bounded(lookup, "GROUP_RANK", 0, kMaxRanks).value_or(0);
    job.restart_count = optional_bounded(lookup, "TORCHELASTIC_RESTART_COUNT", 0, kMaxRanks).value_or(0);
    job.agent_store = lookup("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  } else if (lookup("OMPI_COMM_WORLD_RANK") && lookup("OMPI_COMM_WORLD_SIZE")) {
    job.launcher = Launcher::kMpi;
    job.world_size = bounded(lookup, "OMPI_COMM_WORLD_SIZE", 1, kMaxRanks);
    job.rank = bounded(lookup, "OMPI_COMM_WORLD_RANK", 0, job.world_size - 1);
    job.local_rank = optional_bounded(lookup, "OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxRanks).value_or(job.rank);
    job.local_world_size =
        optional_bounded(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxRanks).value_or(job.world_size);
    job.node_rank = optional_bounded(lookup, "OMPI_COMM_WORLD_NODE_RANK", 0, kMaxRanks).value_or(0);
    TORCH_CHECK(lookup("MASTER_ADDR") || job.local_world_size == job.world_size,
                "mpirun placed ranks on several nodes (OMPI_COMM_WORLD_LOCAL_SIZE=", job.local_world_size,
                " of OMPI_COMM_WORLD_SIZE=", job.world_size,
                "): set MASTER_ADDR (mpirun -x MASTER_ADDR=<rank 0's host>) or pass --master-addr");
  } else if (lookup("SLURM_PROCID") && lookup("SLURM_NTASKS")) {
    job.launcher = Launcher::kSlurm;
    job.world_size = bounded(lookup, "SLURM_NTASKS", 1, kMaxRanks);
    job.rank = bounded(lookup, "SLURM_PROCID", 0, job.world_size - 1);
    job.local_rank = optional_bounded(lookup, "SLURM_LOCALID", 0, kMaxRanks).value_or(0);
    job.local_world_size =
        optional_bounded(lookup, "SLURM_NTASKS_PER_NODE", 1, kMaxRanks).value_or(job.world_size);
    job.node_rank = optional_bounded(lookup, "SLURM_NODEID", 0, kMaxRanks).value_or(0);
    if (!lookup("MASTER_ADDR")) {
      const auto nodes = lookup("SLURM_JOB_NODELIST") ? lookup("SLURM_JOB_NODELIST") : lookup("SLURM_NODELIST");
      TORCH_CHECK(nodes.has_value(), "under Slurm, dkfac needs MASTER_ADDR or SLURM_JOB_NODELIST to find rank 0's host");
      const auto hosts = expand_slurm_hostlist(*nodes);
      TORCH_CHECK(!hosts.empty(), "SLURM_JOB_NODELIST='", *nodes, "' names no host");
      job.host = hosts.front();
    }
    if (!lookup("MASTER_PORT")) {
      TORCH_CHECK(lookup("SLURM_JOB_ID").has_value(),
                  "under Slurm, dkfac needs MASTER_PORT or SLURM_JOB_ID to choose the rendezvous port");
      job.port = slurm_port(integer(lookup, "SLURM_JOB_ID"));
    }
  } else {
    return job;
  }
  if (const auto address = lookup("MASTER_ADDR")) {
    TORCH_CHECK(!address->empty(), "environment variable MASTER_ADDR is empty");
    job.host = *address;
  }
  if (lookup("MASTER_PORT")) job.port = bounded(lookup, "MASTER_PORT", 1, 65535);
  return job;
}

JobEnvironment read_job_environment() {
  return read_job_environment([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    return value ? std::optional<std::string>(value) : std::nullopt;
  });
}

std::string JobEnvironment::describe() const {
  std::ostringstream out;
  out << world_size << (world_size == 1 ? " rank" : " ranks") << " from " << to_string(launcher);
  if (launcher != Launcher::kNone) {
    out << ", rendezvous at " << host << ":" << port;
    if (agent_store) out << " (the agent's store)";
    if (restart_count > 0) out << ", restart " << restart_count;
  }
  return out.str();
}

RendezvousOptions JobEnvironment::rendezvous(std::chrono::milliseconds timeout) const {
  RendezvousOptions options;
  options.host = host;
  options.port = port;
  options.rank = rank;
  options.world_size = world_size;
  options.timeout = timeout;
  options.external_store = agent_store;
  if (restart_count > 0) options.key_prefix = "dkfac/restart" + std::to_string(restart_count) + "/";
  return options;
}

std::shared_ptr<Communicator> Communicator::from_environment(std::chrono::milliseconds timeout) {
  const auto job = read_job_environment();
  if (job.world_size == 1) return connect_in_process(std::make_shared<InProcessStore>(), 0, 1, timeout);
  return connect(job.rendezvous(timeout));
}

}  // namespace dkfac::comm
