// The tool's flag parse as a fuzz target (tests/fuzz/tool_args_fuzz_target.h), replayed in CI on
// mutations of the seed corpus (tests/fuzz/corpus/tool_args/, one valid command line per subcommand):
// every argv parses or is refused with a message, never a crash or another exception. The mutations
// write every flag of every subcommand (read from the registered app) and boundary values.
// scripts/fuzz.sh runs the same target under libFuzzer with sanitizers.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "fuzz/tool_args_fuzz_target.h"

namespace {

using megamoe::fuzz::tool_args_one_input;

int parse(const std::string& input) {
  return tool_args_one_input(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

// The refusal's message for `input` ("" when it parses).
std::string refusal(const std::string& input) {
  std::vector<std::string> args = megamoe::fuzz::split_lines(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  args.insert(args.begin(), "megamoe");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::string message;
  megamoe::tool::parse_tool_args(static_cast<int>(argv.size()), argv.data(), &message);
  return message;
}

// Every subcommand's name and every flag name it registers.
std::vector<std::string> command_words(std::set<std::string>* commands) {
  CLI::App app;
  megamoe::tool::add_all_commands(&app);
  std::vector<std::string> words;
  for (const CLI::App* sub : app.get_subcommands({})) {
    commands->insert(sub->get_name());
    words.push_back(sub->get_name());
    for (const CLI::Option* opt : sub->get_options()) {
      for (const std::string& l : opt->get_lnames()) words.push_back("--" + l);
      for (const std::string& s : opt->get_snames()) words.push_back("-" + s);
    }
  }
  return words;
}

TEST(ToolArgsFuzz, SeedsAreValidCommandLinesOfEverySubcommand) {
  std::set<std::string> commands;
  command_words(&commands);
  std::set<std::string> seeded;
  for (const std::string& seed : megamoe::fuzz::read_corpus(MEGAMOE_SOURCE_DIR "/tests/fuzz/corpus/tool_args")) {
    EXPECT_EQ(parse(seed), megamoe::tool::kExitOk) << seed << "\n" << refusal(seed);
    seeded.insert(seed.substr(0, seed.find('\n')));
  }
  for (const std::string& c : commands) EXPECT_TRUE(seeded.count(c)) << "no seed for megamoe " << c;
}

TEST(ToolArgsFuzz, MutationsOfTheSeedCorpusAreHandled) {
  const std::vector<std::string> seeds = megamoe::fuzz::read_corpus(MEGAMOE_SOURCE_DIR "/tests/fuzz/corpus/tool_args");
  ASSERT_GE(seeds.size(), 9u);
  std::set<std::string> commands;
  std::vector<std::string> tokens = command_words(&commands);
  for (const char* v : {"\n", "\n0", "\n-1", "\n1e9", "\nnan", "\ninf", "\n-inf", "\n0x10", "\n18446744073709551616",
                        "\n1,,2", "\n,", "\n", "=", "\n--", "\n-", "\n-h", "\n--help", "\n--version", "\n{", "\n[]",
                        "\n\xff", "\n2147483648", "\n-2147483649", "\n1.5", "\n 1", "\nauto", "\nall"})
    tokens.push_back(v);
  std::mt19937 rng(6u);
  int64_t parsed = 0, refused = 0;
  for (int it = 0; it < 20000; ++it) {
    std::string input = seeds[rng() % seeds.size()];
    megamoe::fuzz::mutate(&input, &rng, tokens);
    (parse(input) == megamoe::tool::kExitOk ? parsed : refused)++;
  }
  std::printf("%lld parsed, %lld refused\n", (long long)parsed, (long long)refused);
  EXPECT_GT(parsed, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
