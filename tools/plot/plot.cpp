#include "tools/plot/plot.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace dkfac::plot {

Curve read_curve(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open metrics file '" + path + "'");
  Curve curve;
  curve.label = std::filesystem::path(path).stem().string();
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    nlohmann::json event;
    try {
      event = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error("metrics file '" + path + "' line " + std::to_string(number) + ": " + e.what());
    }
    if (event.value("event", "") != "epoch") continue;
    curve.epoch.push_back(event.at("epoch").get<double>());
    curve.wall_time_s.push_back(event.at("wall_time_s").get<double>());
    curve.test_accuracy.push_back(100.0 * event.at("test_accuracy").get<double>());
    curve.test_loss.push_back(event.at("test_loss").get<double>());
  }
  if (curve.epoch.empty()) throw std::runtime_error("metrics file '" + path + "' has no epoch events");
  return curve;
}

void plot_metrics(const std::vector<std::string>& paths, const std::string& output_png) {
  const auto dir = std::filesystem::temp_directory_path() / ("dkfac-plot-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<Curve> curves;
  for (const auto& p : paths) curves.push_back(read_curve(p));
  for (size_t i = 0; i < curves.size(); ++i) {
    std::ofstream data(dir / ("run" + std::to_string(i) + ".dat"));
    for (size_t k = 0; k < curves[i].epoch.size(); ++k) {
      data << curves[i].epoch[k] << " " << curves[i].wall_time_s[k] << " " << curves[i].test_accuracy[k] << " "
           << curves[i].test_loss[k] << "\n";
    }
  }
  auto series = [&](int x, int y) {
    std::ostringstream out;
    for (size_t i = 0; i < curves.size(); ++i) {
      out << (i ? ", " : "") << "'" << (dir / ("run" + std::to_string(i) + ".dat")).string() << "' using " << x
          << ":" << y << " with linespoints lw 2 title '" << curves[i].label << "'";
    }
    return out.str();
  };
  std::ofstream script(dir / "plot.gp");
  script << "set terminal pngcairo size 1400,1000 font 'sans,11'\n"
         << "set output '" << output_png << "'\n"
         << "set multiplot layout 2,2 title 'dkfac training curves'\n"
         << "set grid\nset key bottom right\n"
         << "set xlabel 'epoch'\nset ylabel 'test accuracy (%)'\nplot " << series(1, 3) << "\n"
         << "set xlabel 'wall time (s)'\nset ylabel 'test accuracy (%)'\nplot " << series(2, 3) << "\n"
         << "set key top right\n"
         << "set xlabel 'epoch'\nset ylabel 'test loss'\nplot " << series(1, 4) << "\n"
         << "set xlabel 'wall time (s)'\nset ylabel 'test loss'\nplot " << series(2, 4) << "\n"
         << "unset multiplot\n";
  script.close();
  const std::string command = "gnuplot '" + (dir / "plot.gp").string() + "'";
  const int rc = std::system(command.c_str());
  std::filesystem::remove_all(dir);
  if (rc != 0) throw std::runtime_error("gnuplot failed (exit " + std::to_string(rc) + "); is gnuplot-nox installed?");
}

}  // namespace dkfac::plot
