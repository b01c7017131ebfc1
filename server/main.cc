// twinkle-server: the coordinator. Subcommands:
//   launch -c FILE [--port-file PATH]   serve until SIGTERM/SIGINT
//   check-config -c FILE                validate a config (exit 2 on errors)
//   print-config -c FILE [--format yaml|json]   the effective config, secrets masked
//   admin --address HOST:PORT <command> ...      runtime tenants and API keys (AdminService;
//                                                the admin key comes from TWINKLE_API_KEY)
//   worker --join HOST:PORT --node NAME --secret-file FILE   a node agent: start this node's
//                                                engines for the coordinator (docs/device_pool.md)
//   node-secret -o FILE                          write a new node secret (mode 0600)

#include <fcntl.h>
#include <unistd.h>

#include <iostream>

#include <CLI/CLI.hpp>

#include "core/common/log.h"
#include "core/engine_client/node_agent.h"
#include "core/ipc/socket.h"
#include "server/admin_cli.h"
#include "server/app.h"
#include "server/config/config.h"
#include "twinkle_version.h"

namespace {

// Exit code for configuration errors, distinct from runtime failures (1).
constexpr int kExitConfigError = 2;

absl::StatusOr<twinkle::Config> Load(const std::string& file) {
  absl::StatusOr<twinkle::Config> config = twinkle::LoadConfigFile(file);
  if (!config.ok()) std::cerr << config.status().message() << std::endl;
  return config;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"twinkle-server: a multi-tenant LoRA training server (coordinator)"};
  app.set_version_flag("--version", std::string("twinkle-server ") + twinkle::kTwinkleVersion +
                                        " (" + twinkle::kTwinkleGitCommit + ")");
  app.require_subcommand(1);

  std::string config_file, port_file, format = "yaml";
  CLI::App* launch = app.add_subcommand("launch", "start the server and serve until SIGTERM/SIGINT");
  launch->add_option("-c,--config", config_file, "YAML config file")->required();
  launch->add_option("--port-file", port_file,
                     "write {grpc_port, http_port, pid} as JSON here once listening");
  CLI::App* check = app.add_subcommand("check-config", "validate a config file; exit 2 on errors");
  check->add_option("-c,--config", config_file, "YAML config file")->required();
  CLI::App* print = app.add_subcommand("print-config", "print the effective config (secrets masked)");
  print->add_option("-c,--config", config_file, "YAML config file")->required();
  print->add_option("--format", format, "yaml or json")->check(CLI::IsMember({"yaml", "json"}));
  twinkle::AdminCliOptions admin_options;
  CLI::App* admin = app.add_subcommand("admin", "manage tenants and API keys of a running server (admin role)");
  admin->add_option("--address", admin_options.address, "the server's gRPC host:port")->required();
  admin->add_option("--ca-file", admin_options.ca_file, "TLS: verify the server against this CA (PEM)");
  admin->add_option("--timeout", admin_options.timeout_s, "seconds to wait for the answer");
  admin->require_subcommand(1);
  CLI::App* create_tenant = admin->add_subcommand("create-tenant", "create a tenant");
  create_tenant->add_option("tenant", admin_options.tenant, "tenant id ([a-z0-9_-]{1,64})")->required();
  CLI::App* create_key = admin->add_subcommand("create-key", "create an API key (printed once)");
  create_key->add_option("--tenant", admin_options.tenant, "its tenant")->required();
  create_key->add_option("--role", admin_options.role, "admin, member or read-only")
      ->check(CLI::IsMember({"admin", "member", "read-only"}))
      ->required();
  create_key->add_option("--name", admin_options.name, "a label for it");
  CLI::App* list_keys = admin->add_subcommand("list-keys", "list API keys (never the keys themselves)");
  list_keys->add_option("--tenant", admin_options.tenant, "only this tenant's");
  CLI::App* revoke_key = admin->add_subcommand("revoke-key", "revoke an API key (401 from its next call)");
  revoke_key->add_option("key_id", admin_options.key_id, "the key id")->required();
  CLI::App* rotate_key = admin->add_subcommand("rotate-key", "revoke a key and issue its replacement (printed once)");
  rotate_key->add_option("key_id", admin_options.key_id, "the key id")->required();
  CLI::App* set_role = admin->add_subcommand("set-role", "change a key's role");
  set_role->add_option("key_id", admin_options.key_id, "the key id")->required();
  set_role->add_option("role", admin_options.role, "admin, member or read-only")
      ->check(CLI::IsMember({"admin", "member", "read-only"}))
      ->required();
  twinkle::NodeAgentOptions agent_options;
  std::string agent_log_level = "info";
  CLI::App* worker = app.add_subcommand("worker", "a node agent: start this node's engines for a coordinator");
  worker->add_option("--join", agent_options.join, "the coordinator's nodes.listen, HOST:PORT")->required();
  worker->add_option("--node", agent_options.node, "this node's name, as the coordinator's engine.devices use it (DEVICE@NODE)")
      ->required();
  worker->add_option("--secret-file", agent_options.secret_file, "the node secret (the coordinator's nodes.secret_file)")
      ->required();
  worker->add_option("--engine-binary", agent_options.engine_binary, "twinkle-engine (default: next to this binary)");
  worker->add_option("--log-level", agent_log_level, "debug|info|warning|error");
  std::string secret_out;
  CLI::App* node_secret = app.add_subcommand("node-secret", "write a new node secret for nodes.secret_file (mode 0600)");
  node_secret->add_option("-o,--output", secret_out, "file to create (must not exist)")->required();
  CLI11_PARSE(app, argc, argv);

  if (worker->parsed()) {
    if (agent_options.engine_binary.empty()) agent_options.engine_binary = twinkle::DefaultEngineBinary();
    twinkle::LogLevel level;
    if (twinkle::ParseLogLevel(agent_log_level, &level)) twinkle::SetLogLevel(level);
    absl::Status s = twinkle::RunNodeAgent(agent_options);
    if (!s.ok()) std::cerr << "twinkle-server worker: " << s.message() << std::endl;
    return s.ok() ? 0 : 1;
  }
  if (node_secret->parsed()) {
    absl::StatusOr<std::string> secret = twinkle::ipc::NewNodeSecret();
    const int fd = secret.ok() ? open(secret_out.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600) : -1;
    const std::string line = secret.ok() ? *secret + "\n" : "";
    if (!secret.ok() || fd < 0 || write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      std::cerr << "twinkle-server node-secret: "
                << (secret.ok() ? "cannot create " + secret_out + " (it must not exist yet)"
                                : std::string(secret.status().message()))
                << std::endl;
      if (fd >= 0) close(fd);
      return 1;
    }
    close(fd);
    return 0;
  }

  if (admin->parsed()) {
    for (CLI::App* sub : admin->get_subcommands()) admin_options.command = sub->get_name();
    return twinkle::RunAdminCommand(admin_options);
  }

  // Block the shutdown signals before any thread exists, so only the signal thread sees them.
  if (launch->parsed()) twinkle::BlockShutdownSignals();

  absl::StatusOr<twinkle::Config> config = Load(config_file);
  if (!config.ok()) return kExitConfigError;

  if (check->parsed()) {
    if (absl::Status env = twinkle::CheckEnvironment(*config); !env.ok()) {
      std::cerr << env.message() << std::endl;
      return kExitConfigError;
    }
    std::cout << config_file << ": OK" << std::endl;
    return 0;
  }
  if (print->parsed()) {
    std::cout << twinkle::RenderConfig(
        *config, format == "json" ? twinkle::ConfigFormat::kJson : twinkle::ConfigFormat::kYaml);
    return 0;
  }
  twinkle::LogLevel level;
  if (twinkle::ParseLogLevel(config->logging.level, &level)) twinkle::SetLogLevel(level);
  twinkle::LogFormat log_format;
  if (twinkle::ParseLogFormat(config->logging.format, &log_format)) twinkle::SetLogFormat(log_format);
  return twinkle::RunServer(*config, twinkle::LaunchOptions{port_file});
}
