// Plots of the tool's JSON (`megamoe bench --plot`, `megamoe tune --plot`, `megamoe plot`): the
// script plot.py, embedded in the tool at build time, run by the python3 on PATH with matplotlib.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace CLI {
class App;
}

namespace megamoe::tool {

// Writes the plot of `doc` (bench's or tune's JSON document) to `png`. Throws ToolError: kExitUsage
// for a path that does not end in .png, kExitIo naming `flag`, the path, what went wrong and the fix
// (python3 missing from PATH, matplotlib not importable: `python3 -m pip install matplotlib`, or
// scripts/setup.sh) when no plot was written.
void plot_json(const nlohmann::json& doc, const std::string& png, const std::string& flag);
// The path rule alone, for a command to check before it measures anything.
void check_plot_path(const std::string& png, const std::string& flag);

}  // namespace megamoe::tool
