#include "tools/plot/plot.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace dkfac::plot {
namespace fs = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// The one metrics format read (tools/train/metrics.h); older files are converted by scripts/convert_metrics.py.
constexpr int kMetricsFormat = 3;

std::string where(const std::string& path, int64_t line) {
  return "metrics file '" + path + "' line " + std::to_string(line);
}

std::string shorten(std::string text, size_t max = 60) {
  if (text.size() > max) text = text.substr(0, max) + "...";
  return text;
}

/// event[key] as a number (null, a non-finite value in the writer, reads as NaN); errors name file, line, key.
double number(const nlohmann::json& event, const std::string& key, const std::string& kind, const std::string& path,
              int64_t line) {
  const auto it = event.find(key);
  if (it == event.end()) throw std::runtime_error(where(path, line) + ": " + kind + " event has no '" + key + "'");
  if (it->is_null()) return kNaN;
  if (!it->is_number()) {
    throw std::runtime_error(where(path, line) + ": " + kind + " event's '" + key + "' is not a number: " +
                             shorten(it->dump()));
  }
  return it->get<double>();
}

bool blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(), [](unsigned char c) { return std::isspace(c) != 0; });
}

struct StepPoint {
  double step, epoch, wall, loss;
};
struct EpochPoint {
  double epoch, wall, accuracy, loss;
};

/// A single-quoted gnuplot string: printed as is (no backslash escapes, no backquote or macro substitution).
std::string quote(const std::string& text, const std::string& what) {
  std::string out = "'";
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      throw std::runtime_error(what + " '" + text + "' has a control character; gnuplot cannot be given it");
    }
    out += c;
    if (c == '\'') out += '\'';
  }
  return out + "'";
}

bool any_point(const std::vector<double>& x, const std::vector<double>& y) {
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    if (std::isfinite(x[i]) && std::isfinite(y[i])) return true;
  }
  return false;
}

/// An integer tick step giving at most 10 ticks up to max_epoch: 1, 2, 5, 10, 20, 50, ...
int64_t epoch_tick_step(double max_epoch) {
  for (int64_t scale = 1;; scale *= 10) {
    for (int64_t m : {1, 2, 5}) {
      if (!(max_epoch > 10.0 * m * scale) || scale > (int64_t{1} << 40)) return m * scale;
    }
  }
}

fs::path epochs_file(const fs::path& dir, size_t i) { return dir / ("run" + std::to_string(i) + "-epochs.dat"); }
fs::path steps_file(const fs::path& dir, size_t i) { return dir / ("run" + std::to_string(i) + "-steps.dat"); }

/// A private directory from mkdtemp, removed with everything in it when the guard goes out of scope.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dkfac-plot-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error("cannot create a temporary directory '" + pattern + "': " + std::strerror(errno));
    }
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Writes `rows` lines of four columns, row(k) giving line k's values; non-finite values as NaN. False on failure.
bool write_columns(const fs::path& path, size_t rows, const std::function<std::array<double, 4>(size_t)>& row) {
  std::ofstream out(path);
  out << std::setprecision(12);
  for (size_t k = 0; k < rows; ++k) {
    for (double v : row(k)) {
      if (std::isfinite(v)) {
        out << v;
      } else {
        out << "NaN";
      }
      out << ' ';
    }
    out << '\n';
  }
  out.close();
  return static_cast<bool>(out);
}

void write_data(const Curve& curve, const fs::path& dir, size_t i) {
  const bool epochs = write_columns(epochs_file(dir, i), curve.epoch.size(), [&curve](size_t k) {
    return std::array<double, 4>{curve.epoch[k], curve.wall_time_s[k], curve.test_accuracy[k], curve.test_loss[k]};
  });
  const bool steps = write_columns(steps_file(dir, i), curve.step.size(), [&curve](size_t k) {
    return std::array<double, 4>{curve.step_epoch[k], curve.step_wall_time_s[k], curve.train_loss[k], curve.step[k]};
  });
  if (!epochs || !steps) throw std::runtime_error("cannot write plot data in '" + dir.string() + "'");
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

/// Runs `program script` without a shell, its output into `log`; throws naming the program on failure.
void run_gnuplot(const std::string& program, const fs::path& script, const fs::path& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::string arg0 = program, arg1 = script.string();
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, program.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc == ENOENT) {
    throw std::runtime_error("'" + program + "' was not found (PATH); dkfac plot needs gnuplot: install gnuplot-nox");
  }
  if (rc != 0) throw std::runtime_error("cannot run '" + program + "': " + std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw std::runtime_error("waiting for '" + program + "': " + std::strerror(errno));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  std::string how = WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                                      : "killed by signal " + std::to_string(WTERMSIG(status));
  std::string messages = read_text(log);
  if (messages.size() > 2000) messages = "..." + messages.substr(messages.size() - 2000);
  throw std::runtime_error("'" + program + "' failed (" + how + ")" + (messages.empty() ? "" : ":\n" + messages));
}

}  // namespace

Curve read_curve(const std::string& path, std::ostream& warnings) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open metrics file '" + path + "'");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
  }
  if (in.bad()) throw std::runtime_error("cannot read metrics file '" + path + "'");
  size_t last = lines.size();  // the last non-blank line
  while (last > 0 && blank(lines[last - 1])) --last;

  double format = 0;  // the run event's format_version; 0: no run event yet (format 1 has none)
  std::vector<StepPoint> steps;
  std::vector<EpochPoint> epochs;
  for (size_t i = 0; i < last; ++i) {
    const int64_t number_ = static_cast<int64_t>(i) + 1;
    if (blank(lines[i])) continue;
    nlohmann::json event;
    try {
      event = nlohmann::json::parse(lines[i]);
    } catch (const nlohmann::json::exception& e) {
      if (i + 1 == last) {
        warnings << "dkfac plot: warning: " << where(path, number_)
                 << " does not parse (a write cut short?); ignoring it: " << e.what() << std::endl;
        continue;
      }
      throw std::runtime_error(where(path, number_) + " is not valid JSON: " + e.what());
    }
    if (!event.is_object()) {
      throw std::runtime_error(where(path, number_) + " is not a JSON object: " + shorten(lines[i]));
    }
    const auto kind_it = event.find("event");
    if (kind_it == event.end() || !kind_it->is_string()) continue;
    const std::string kind = kind_it->get<std::string>();
    if (kind == "run") {
      const auto v = event.find("format_version");
      if (v != event.end() && v->is_number()) format = v->get<double>();
    }
    if ((kind == "step" || kind == "epoch") && format < kMetricsFormat) {
      throw std::runtime_error(
          where(path, number_) + ": metrics format " + (format > 0 ? std::to_string(static_cast<int>(format))
                                                                   : std::string("1 (no run event before it)")) +
          "; dkfac plot reads format " + std::to_string(kMetricsFormat) +
          ": convert the file once with `python3 scripts/convert_metrics.py " + path + "`");
    }
    if (kind == "step") {
      StepPoint p{};
      p.step = number(event, "step", kind, path, number_);
      p.loss = number(event, "loss", kind, path, number_);
      p.wall = number(event, "wall_time_s", kind, path, number_);
      p.epoch = number(event, "epoch_progress", kind, path, number_);  // NaN where null (unknown)
      while (!steps.empty() && !(steps.back().step < p.step)) steps.pop_back();  // a resumed run replays
      steps.push_back(p);
    } else if (kind == "epoch") {
      EpochPoint p{};
      p.epoch = number(event, "epoch", kind, path, number_);
      p.wall = number(event, "wall_time_s", kind, path, number_);
      p.accuracy = 100.0 * number(event, "test_accuracy", kind, path, number_);
      p.loss = number(event, "test_loss", kind, path, number_);
      while (!epochs.empty() && !(epochs.back().epoch < p.epoch)) epochs.pop_back();
      epochs.push_back(p);
    }
  }

  Curve curve;
  curve.path = path;
  curve.label = fs::path(path).stem().string();
  for (const auto& p : epochs) {
    curve.epoch.push_back(p.epoch);
    curve.wall_time_s.push_back(p.wall);
    curve.test_accuracy.push_back(p.accuracy);
    curve.test_loss.push_back(p.loss);
  }
  for (const auto& p : steps) {
    curve.step.push_back(p.step);
    curve.step_epoch.push_back(p.epoch);
    curve.step_wall_time_s.push_back(p.wall);
    curve.train_loss.push_back(p.loss);
  }
  return curve;
}

std::vector<std::string> default_labels(const std::vector<std::string>& paths) {
  const size_t n = paths.size();
  std::vector<std::string> labels(n);
  auto shared = [&](size_t i) { return std::count(labels.begin(), labels.end(), labels[i]) > 1; };
  for (size_t i = 0; i < n; ++i) labels[i] = fs::path(paths[i]).stem().string();
  std::vector<bool> by_directory(n);
  for (size_t i = 0; i < n; ++i) by_directory[i] = shared(i);
  for (size_t i = 0; i < n; ++i) {
    if (!by_directory[i]) continue;
    std::error_code ec;
    fs::path absolute = fs::absolute(paths[i], ec).lexically_normal();
    std::string parent = ec ? "" : absolute.parent_path().filename().string();
    labels[i] = parent.empty() ? paths[i] : parent;
  }
  std::vector<bool> by_path(n);
  for (size_t i = 0; i < n; ++i) by_path[i] = shared(i);
  for (size_t i = 0; i < n; ++i) {
    if (by_path[i]) labels[i] = paths[i];
  }
  return labels;
}

std::string gnuplot_script(const std::vector<Curve>& curves, const fs::path& data_dir, const fs::path& png) {
  double max_epoch = 0;
  for (const auto& c : curves) {
    for (double e : c.epoch) max_epoch = std::isfinite(e) ? std::max(max_epoch, e) : max_epoch;
    for (double e : c.step_epoch) max_epoch = std::isfinite(e) ? std::max(max_epoch, e) : max_epoch;
  }
  std::vector<std::string> labels, epoch_files, step_files;
  for (size_t i = 0; i < curves.size(); ++i) {
    labels.push_back(quote(curves[i].label, "label"));
    epoch_files.push_back(quote(epochs_file(data_dir, i).string(), "temporary path"));
    step_files.push_back(quote(steps_file(data_dir, i).string(), "temporary path"));
  }

  std::ostringstream s;
  s << "set terminal pngcairo noenhanced size 1400,1500 font 'sans,11'\n"
    << "set output " << quote(png.string(), "output path") << "\n"
    << "set multiplot layout 3,2 title 'dkfac training curves'\n"
    << "set grid\n";
  // One panel: y column `y` of the epoch (from_steps false) or step data against epochs or wall time.
  auto panel = [&](bool from_steps, bool against_epoch, int y, const std::string& ylabel, const std::string& key) {
    const int x = against_epoch ? 1 : 2;
    s << "set autoscale\n";
    if (against_epoch) {
      s << "set xlabel 'epoch'\nset xtics " << epoch_tick_step(max_epoch) << "\nset format x '%g'\n";
    } else {
      s << "set xlabel 'wall time (s)'\nset xtics autofreq\nset format x\n";
    }
    s << "set ylabel '" << ylabel << "'\nset key " << key << "\n";
    std::vector<std::string> series;
    for (size_t i = 0; i < curves.size(); ++i) {
      const Curve& c = curves[i];
      const auto& xs = from_steps ? (against_epoch ? c.step_epoch : c.step_wall_time_s)
                                  : (against_epoch ? c.epoch : c.wall_time_s);
      const auto& ys = from_steps ? c.train_loss : (y == 3 ? c.test_accuracy : c.test_loss);
      if (!any_point(xs, ys)) continue;
      std::ostringstream one;
      one << (from_steps ? step_files[i] : epoch_files[i]) << " using " << x << ":" << y << " with "
          << (from_steps ? "lines" : "linespoints") << " lt " << i + 1 << " lw 2 title " << labels[i];
      series.push_back(one.str());
    }
    if (series.empty()) {
      s << "set xrange [0:1]\nset yrange [0:1]\nset label 1 'no data' at graph 0.5,0.5 center\n"
        << "plot 2 notitle\nunset label 1\n";
      return;
    }
    s << "plot ";
    for (size_t k = 0; k < series.size(); ++k) s << (k ? ", \\\n     " : "") << series[k];
    s << "\n";
  };
  panel(false, true, 3, "test accuracy (%)", "bottom right");
  panel(false, false, 3, "test accuracy (%)", "bottom right");
  panel(false, true, 4, "test loss", "top right");
  panel(false, false, 4, "test loss", "top right");
  panel(true, true, 3, "training loss (steps)", "top right");
  panel(true, false, 3, "training loss (steps)", "top right");
  s << "unset multiplot\n";
  return s.str();
}

void plot_metrics(const std::vector<std::string>& paths, const std::string& output_png, const PlotOptions& options) {
  if (paths.empty()) throw std::runtime_error("dkfac plot needs at least one metrics file");
  if (!options.labels.empty() && options.labels.size() != paths.size()) {
    throw std::runtime_error("--label was given " + std::to_string(options.labels.size()) + " times for " +
                             std::to_string(paths.size()) + " metrics files; give one per file, in order");
  }
  if (output_png.empty()) throw std::runtime_error("the output file name (-o) is empty");
  fs::path output(output_png);
  const fs::path directory = output.has_parent_path() ? output.parent_path() : fs::path(".");
  if (!fs::is_directory(directory)) {
    throw std::runtime_error("the output directory '" + directory.string() + "' of '" + output_png +
                             "' does not exist");
  }
  if (fs::is_directory(output)) throw std::runtime_error("the output '" + output_png + "' is a directory");

  std::ostream& warnings = options.warnings ? *options.warnings : std::cerr;
  const auto labels = options.labels.empty() ? default_labels(paths) : options.labels;
  std::vector<Curve> curves;
  bool any = false;
  for (size_t i = 0; i < paths.size(); ++i) {
    curves.push_back(read_curve(paths[i], warnings));
    curves.back().label = labels[i];
    if (curves.back().empty()) {
      warnings << "dkfac plot: warning: metrics file '" << paths[i] << "' has no step or epoch events" << std::endl;
    }
    any = any || !curves.back().empty();
  }
  if (!any) throw std::runtime_error("no step or epoch events in any metrics file; nothing to plot");

  TempDir temp;
  for (size_t i = 0; i < curves.size(); ++i) write_data(curves[i], temp.path(), i);
  const fs::path png = temp.path() / "plot.png", script = temp.path() / "plot.gp";
  {
    std::ofstream out(script);
    out << gnuplot_script(curves, temp.path(), png);
    out.close();
    if (!out) throw std::runtime_error("cannot write '" + script.string() + "'");
  }
  run_gnuplot(options.gnuplot, script, temp.path() / "gnuplot.log");
  std::error_code ec;
  if (!fs::is_regular_file(png, ec) || fs::file_size(png, ec) == 0) {
    throw std::runtime_error("'" + options.gnuplot + "' wrote no image:\n" + read_text(temp.path() / "gnuplot.log"));
  }
  fs::rename(png, output, ec);  // across file systems: copy
  if (ec) {
    fs::copy_file(png, output, fs::copy_options::overwrite_existing, ec);
    if (ec) throw std::runtime_error("cannot write '" + output_png + "': " + ec.message());
  }
}

}  // namespace dkfac::plot
