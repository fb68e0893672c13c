#include "tools/train/training_checkpoint.h"

#include <sstream>

#include <nlohmann/json.hpp>

namespace dkfac::train {
namespace {

// Every option that changed since the checkpoint, "" when none did. A changed --seed is refused unless
// --allow-seed-change (it decides each epoch's order of examples).
std::string changed_options(torch::serialize::InputArchive& archive, const std::string& path,
                            const TrainConfig& config) {
  c10::IValue written;
  TORCH_CHECK(archive.try_read("options", written) && written.isString(), "checkpoint '", path,
              "' has no readable 'options' entry: the file is damaged");
  const auto theirs = nlohmann::json::parse(written.toStringRef(), nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(theirs.is_object(), "checkpoint '", path, "' has a damaged 'options' entry");
  const auto mine = to_json(config);
  std::string changed;
  for (const auto& [key, value] : mine.items()) {
    if (key == "resume" || key == "overwrite" || key == "allow-seed-change") continue;  // how this run starts
    if (key == "batch-size" && config.global_batch_size > 0) continue;  // --global-batch-size / ranks
    const auto it = theirs.find(key);
    if (it == theirs.end() || *it == value) continue;  // an option the writer's build did not have: no change
    // Each epoch's order of examples (and the augmentation) comes from the seed: a new one would go on with
    // another order, seeing some of this epoch's examples twice and others not at all.
    TORCH_CHECK(key != "seed" || config.allow_seed_change, "checkpoint '", path, "' was written with --seed ",
                it->dump(), ", this run has --seed ", value.dump(), ": the seed decides each epoch's order of "
                "examples, so the run would not go on as the one that wrote it; pass --seed ", it->dump(),
                ", or --allow-seed-change to go on with the new seed's order");
    changed += (changed.empty() ? "" : ", ") + ("--" + key) + " " + it->dump() + " -> " + value.dump();
  }
  return changed;
}

}  // namespace

std::string shape_signature(torch::nn::Module& model) {
  std::ostringstream out;
  for (const auto& p : model.named_parameters()) out << p.key() << p.value().sizes() << ";";
  return out.str();
}

void write_checkpoint(torch::serialize::OutputArchive& archive, const TrainConfig& config,
                      const CheckpointIdentity& identity, const CheckpointProgress& progress, TrainingParts parts) {
  archive.write("format_version", c10::IValue(kCheckpointVersion));
  archive.write("options", c10::IValue(to_json(config).dump()));  // for the resume's list of changed options
  archive.write("model_name", c10::IValue(identity.model_name));
  archive.write("dataset", c10::IValue(identity.dataset));
  archive.write("kfac", c10::IValue(identity.kfac));
  archive.write("optimizer_name", c10::IValue(identity.optimizer_name));
  archive.write("shapes", c10::IValue(identity.shapes));
  archive.write("layout", c10::IValue(identity.layout));
  archive.write("job_layout", c10::IValue(identity.job_layout));
  archive.write("world_size", c10::IValue(progress.world_size));
  archive.write("global_batch", c10::IValue(progress.global_batch));
  archive.write("epoch", c10::IValue(progress.epoch));
  archive.write("step_in_epoch", c10::IValue(progress.step_in_epoch));
  archive.write("epoch_examples", c10::IValue(progress.epoch_examples));
  archive.write("global_step", c10::IValue(progress.global_step));
  archive.write("best_accuracy", c10::IValue(progress.best_accuracy));
  archive.write("wall_seconds", c10::IValue(progress.wall_seconds));
  archive.write("rng", torch::globalContext().defaultGenerator(torch::kCPU).get_state(), /*is_buffer=*/true);
  torch::serialize::OutputArchive model, optimizer;
  parts.model.save(model);
  parts.optimizer.save(optimizer);
  archive.write("model", model);
  archive.write("optimizer", optimizer);
  if (parts.kfac) {
    torch::serialize::OutputArchive kfac;
    parts.kfac->save(kfac);  // collective: every rank's archive holds every layer's state
    archive.write("preconditioner", kfac);
  }
}

Resumed read_checkpoint(torch::serialize::InputArchive& archive, const std::string& path, const TrainConfig& config,
                        const CheckpointIdentity& identity, TrainingParts parts) {
  auto read = [&](const char* key) {
    c10::IValue v;
    TORCH_CHECK(archive.try_read(key, v), "checkpoint '", path, "' has no '", key, "' entry");
    return v;
  };
  const int64_t version = read("format_version").toInt();
  TORCH_CHECK(version == kCheckpointVersion, "checkpoint '", path, "' has format version ", version,
              "; this build reads version ", kCheckpointVersion, " only");
  auto expect = [&](const char* key, const std::string& mine) {
    const auto value = read(key);
    TORCH_CHECK(value.isString(), "checkpoint '", path, "' has a damaged '", key, "' entry");
    const auto theirs = value.toStringRef();
    TORCH_CHECK(theirs == mine, "checkpoint '", path, "' was written with ", key, " '", theirs, "', this run uses '",
                mine, "'");
  };
  expect("model_name", identity.model_name);
  expect("dataset", identity.dataset);
  expect("optimizer_name", identity.optimizer_name);
  expect("shapes", identity.shapes);
  const auto theirs = read("job_layout");
  TORCH_CHECK(theirs.isString(), "checkpoint '", path, "' has a damaged 'job_layout' entry");
  TORCH_CHECK(theirs.toStringRef() == identity.job_layout, "checkpoint '", path, "' was written with layout '",
              read("layout").toStringRef(), "', this run uses '", identity.layout, "' (a resume may change the "
              "number of ranks, not the strategy or placement)");
  TORCH_CHECK(read("kfac").toBool() == identity.kfac, "checkpoint '", path, "' was written ",
              read("kfac").toBool() ? "with" : "without", " K-FAC; pass ", read("kfac").toBool() ? "--kfac" : "--no-kfac");
  Resumed out;
  out.changed_options = changed_options(archive, path, config);
  auto& p = out.progress;
  p.world_size = read("world_size").toInt();
  p.global_batch = read("global_batch").toInt();
  p.epoch = read("epoch").toInt();
  p.step_in_epoch = read("step_in_epoch").toInt();
  p.epoch_examples = read("epoch_examples").toInt();
  p.global_step = read("global_step").toInt();
  p.best_accuracy = read("best_accuracy").toDouble();
  p.wall_seconds = read("wall_seconds").toDouble();
  torch::serialize::InputArchive model, optimizer;
  archive.read("model", model);
  archive.read("optimizer", optimizer);
  parts.model.load(model);
  parts.optimizer.load(optimizer);
  if (parts.kfac) {
    torch::serialize::InputArchive kfac;
    archive.read("preconditioner", kfac);
    out.restore = parts.kfac->load(kfac);  // collective where it recomputes: every rank loads the same step
  }
  torch::Tensor rng;
  archive.read("rng", rng, /*is_buffer=*/true);
  at::Generator generator = torch::globalContext().defaultGenerator(torch::kCPU);  // a handle to the global one
  generator.set_state(rng.to(torch::kCPU));  // the CPU generator's state, read onto the run's device with the rest
  return out;
}

}  // namespace dkfac::train
