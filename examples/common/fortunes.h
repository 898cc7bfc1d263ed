// Where the examples' English text comes from: Debian's `fortunes` package.
#pragma once

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace examples {

/// The package's text files in `dir` (not the .dat indexes, not the ASCII-art collections),
/// in name order; an error naming `dir` and the package when it is not there.
inline std::vector<std::filesystem::path> fortune_files(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) {
    throw std::runtime_error("no fortunes in '" + dir +
                             "': install Debian's package with `apt-get install fortunes`");
  }
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (entry.is_regular_file() && !entry.path().has_extension() && name != "art" &&
        name != "ascii-art") {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace examples
