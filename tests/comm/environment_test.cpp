// Launcher environments: which variables name the job, and the errors for bad ones.
#include <gtest/gtest.h>

#include <map>

#include "dkfac/comm/environment.h"

namespace dkfac::comm {
namespace {

JobEnvironment read(const std::map<std::string, std::string>& env) {
  return read_job_environment([&env](const std::string& name) -> std::optional<std::string> {
    const auto it = env.find(name);
    return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
  });
}

std::string error_of(const std::map<std::string, std::string>& env) {
  try {
    read(env);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(Environment, NoLauncherIsOneProcess) {
  const auto job = read({});
  EXPECT_EQ(job.launcher, Launcher::kNone);
  EXPECT_EQ(job.world_size, 1);
  EXPECT_EQ(job.rank, 0);
}

TEST(Environment, ElasticAgentWithItsStore) {
  // What torch 1.13's LocalElasticAgent sets for a worker under the static rendezvous.
  const auto job = read({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                         {"GROUP_RANK", "1"}, {"MASTER_ADDR", "node1"}, {"MASTER_PORT", "29400"},
                         {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_RUN_ID", "job"},
                         {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(job.launcher, Launcher::kTorchElastic);
  EXPECT_EQ(job.rank, 3);
  EXPECT_EQ(job.world_size, 4);
  EXPECT_EQ(job.local_rank, 1);
  EXPECT_EQ(job.local_world_size, 2);
  EXPECT_EQ(job.node_rank, 1);
  EXPECT_EQ(job.host, "node1");
  EXPECT_EQ(job.port, 29400);
  EXPECT_TRUE(job.agent_store);
  EXPECT_EQ(job.restart_count, 2);
  const auto rendezvous = job.rendezvous(std::chrono::seconds(5));
  EXPECT_TRUE(rendezvous.external_store);
  EXPECT_EQ(rendezvous.key_prefix, "dkfac/restart2/");  // never the first attempt's keys
  EXPECT_NE(job.describe().find("torch elastic agent"), std::string::npos);
}

TEST(Environment, ElasticAgentC10dBackendHostsNoStore) {
  const auto job = read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "job"},
                         {"TORCHELASTIC_USE_AGENT_STORE", "False"}, {"TORCHELASTIC_RESTART_COUNT", "0"}});
  EXPECT_EQ(job.launcher, Launcher::kTorchElastic);
  EXPECT_FALSE(job.agent_store);
  EXPECT_EQ(job.rendezvous(std::chrono::seconds(5)).key_prefix, "dkfac/");
}

TEST(Environment, ByHandRankAndWorldSize) {
  const auto job = read({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(job.launcher, Launcher::kEnv);
  EXPECT_EQ(job.host, "127.0.0.1");
  EXPECT_EQ(job.port, 29500);
  EXPECT_EQ(job.local_rank, 1);
}

TEST(Environment, OpenMpi) {
  const auto job = read({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                         {"MASTER_PORT", "31000"}});
  EXPECT_EQ(job.launcher, Launcher::kMpi);
  EXPECT_EQ(job.rank, 2);
  EXPECT_EQ(job.world_size, 4);
  EXPECT_EQ(job.local_rank, 2);
  EXPECT_EQ(job.host, "127.0.0.1");
  EXPECT_EQ(job.port, 31000);
}

TEST(Environment, OpenMpiAcrossNodesNeedsAnAddress) {
  const std::map<std::string, std::string> env = {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  EXPECT_NE(error_of(env).find("set MASTER_ADDR"), std::string::npos) << error_of(env);
  auto with_address = env;
  with_address["MASTER_ADDR"] = "head";
  EXPECT_EQ(read(with_address).host, "head");
}

TEST(Environment, SlurmDerivesAddressAndPort) {
  const auto job = read({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                         {"SLURM_NODEID", "2"}, {"SLURM_JOB_NODELIST", "gpu[07-09,12],login1"},
                         {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(job.launcher, Launcher::kSlurm);
  EXPECT_EQ(job.rank, 5);
  EXPECT_EQ(job.world_size, 8);
  EXPECT_EQ(job.local_rank, 1);
  EXPECT_EQ(job.node_rank, 2);
  EXPECT_EQ(job.host, "gpu07");
  EXPECT_EQ(job.port, 23456);  // 20000 + 123456 mod 10000
}

TEST(Environment, SlurmKeepsMasterVariables) {
  const auto job = read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "a[1-2]"},
                         {"SLURM_JOB_ID", "7"}, {"MASTER_ADDR", "10.0.0.5"}, {"MASTER_PORT", "40000"}});
  EXPECT_EQ(job.host, "10.0.0.5");
  EXPECT_EQ(job.port, 40000);
}

TEST(Environment, MpirunInsideSlurmIsMpi) {
  const auto job = read({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"},
                         {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(job.launcher, Launcher::kMpi);
  EXPECT_EQ(job.world_size, 2);
}

TEST(Environment, BadValuesNameTheVariable) {
  EXPECT_NE(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}).find("RANK='abc' is not an integer"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK=2 is outside 0..1"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}).find("WORLD_SIZE=0"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}).find("MASTER_PORT=70000"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2 "}}).find("WORLD_SIZE='2 '"), std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "1"}}).find("SLURM_JOB_NODELIST"),
            std::string::npos);
}

TEST(SlurmHostlist, Expands) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_slurm_hostlist("node1"), V{"node1"});
  EXPECT_EQ(expand_slurm_hostlist("node[01-04,07],gpu3"), (V{"node01", "node02", "node03", "node04", "node07", "gpu3"}));
  EXPECT_EQ(expand_slurm_hostlist("a[8-11]"), (V{"a8", "a9", "a10", "a11"}));
  EXPECT_EQ(expand_slurm_hostlist("r[1-2]n[1-2]"), (V{"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(expand_slurm_hostlist("x[009-011]"), (V{"x009", "x010", "x011"}));
  EXPECT_EQ(expand_slurm_hostlist("h1,h2"), (V{"h1", "h2"}));
}

TEST(SlurmHostlist, MalformedIsAnError) {
  EXPECT_THROW(expand_slurm_hostlist("node[1-3"), c10::Error);
  EXPECT_THROW(expand_slurm_hostlist("node1-3]"), c10::Error);
  EXPECT_THROW(expand_slurm_hostlist("node[a-b]"), c10::Error);
  EXPECT_THROW(expand_slurm_hostlist("node[3-1]"), c10::Error);
}

}  // namespace
}  // namespace dkfac::comm
