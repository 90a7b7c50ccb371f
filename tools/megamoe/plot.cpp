// See plot.h. The script's text is plot_script.h's kPlotScript (generated from plot.py by CMake), so
// an installed or build-tree binary needs no file beside it.
#include "plot.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench_harness.h"
#include "commands.h"
#include "plot_script.h"
#include "presets.h"

extern char** environ;

namespace megamoe::tool {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFix =
    "install them with `python3 -m pip install matplotlib` (scripts/setup.sh does), or plot the --json file "
    "later on a machine that has them: `megamoe plot FILE.json FILE.png`";

// A temporary directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "megamoe_plot_XXXXXX").string();
    if (mkdtemp(tmpl.data())) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Runs `python3 script in out` with stderr into `err`; the exit status, or -1 with errno when python3
// could not be started.
int run_python(const std::string& script, const std::string& in, const std::string& out, const std::string& err,
               int* spawn_errno) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  std::string prog = "python3";
  std::vector<char*> argv = {prog.data(), const_cast<char*>(script.c_str()), const_cast<char*>(in.c_str()),
                             const_cast<char*>(out.c_str()), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, "python3", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    *spawn_errno = rc;
    return -1;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  constexpr size_t kMax = 600;  // the end of a traceback says what went wrong
  return s.size() > kMax ? "..." + s.substr(s.size() - kMax) : s;
}

}  // namespace

void check_plot_path(const std::string& png, const std::string& flag) {
  if (png.size() < 5 || png.substr(png.size() - 4) != ".png")
    throw ToolError(kExitUsage, "invalid value for " + flag + ": '" + png + "', must be a file name ending in .png");
}

void plot_json(const nlohmann::json& doc, const std::string& png, const std::string& flag) {
  check_plot_path(png, flag);
  TempDir dir;
  if (dir.path().empty()) throw ToolError(kExitIo, flag + ": cannot create a temporary directory for the plot script");
  const std::string script = dir.path() + "/plot.py", in = dir.path() + "/in.json", err = dir.path() + "/stderr.txt";
  write_text_file(script, kPlotScript, flag);
  write_text_file(in, doc.dump(), flag);
  int spawn_errno = 0;
  const int rc = run_python(script, in, png, err, &spawn_errno);
  const std::string where = flag + ": cannot write the plot " + png;
  if (rc < 0)
    throw ToolError(kExitIo, where + ": python3 could not be started (" + std::strerror(spawn_errno) +
                                 "); the plot needs python3 with matplotlib on PATH: " + kFix);
  if (rc == 3)
    throw ToolError(kExitIo, where + ": " + read_text(err) + "; the plot needs matplotlib: " + kFix);
  if (rc != 0) throw ToolError(kExitIo, where + ": the plot script exited with " + std::to_string(rc) + ": " + read_text(err));
  std::error_code ec;
  if (!fs::is_regular_file(png, ec)) throw ToolError(kExitIo, where + ": the plot script wrote no file");
}

CommandRun add_plot_command(CLI::App* app) {
  auto in = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  CLI::App* sub = app->add_subcommand(
      "plot", "plot a `megamoe bench --json` or `megamoe tune --json` file as a PNG (python3 with matplotlib)");
  sub->add_option("json", *in, "the JSON file")->required()->type_name("FILE.json");
  sub->add_option("png", *out, "the PNG to write")->required()->type_name("FILE.png");
  return [in, out] {
    std::ifstream f(*in);
    if (!f) throw ToolError(kExitUsage, "cannot read " + *in);
    nlohmann::json doc = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded()) throw ToolError(kExitUsage, *in + " is not valid JSON");
    plot_json(doc, *out, "megamoe plot");
    std::printf("plot: %s\n", out->c_str());
    return kExitOk;
  };
}

}  // namespace megamoe::tool
