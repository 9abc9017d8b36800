// RemoveAbandonedShmSegments on a scratch directory standing in for
// /dev/shm: it removes exactly the segments whose creator is gone and that
// are old enough, and nothing else.

#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <utime.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cc/transport/shm_plane.h"

namespace mpistrategy {
namespace {

// A PID that no process has: a child that has exited and been reaped.
pid_t DeadPid() {
  const pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, nullptr, 0);
  return pid;
}

class ShmSegmentsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shm_segments_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::system(("rm -rf " + dir_).c_str());
  }

  // Creates dir_/name, last modified `age_seconds` ago; returns its path.
  std::string Make(const std::string& name, int age_seconds) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << "x";
    const time_t then = std::time(nullptr) - age_seconds;
    struct utimbuf times = {then, then};
    utime(path.c_str(), &times);
    return path;
  }

  bool Exists(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0;
  }

  std::string dir_;
};

TEST_F(ShmSegmentsTest, RemovesOnlyOldSegmentsOfDeadCreators) {
  const std::string dead = std::to_string(DeadPid());
  const std::string alive = std::to_string(getpid());
  const std::string abandoned = Make("mpistrategy-" + dead + "-0-1-0", 700);
  const std::string young = Make("mpistrategy-" + dead + "-1-2-0", 10);
  const std::string live = Make("mpistrategy-" + alive + "-0-3-0", 700);
  const std::string foreign = Make("vader_segment." + dead + ".0", 700);
  const std::string no_pid = Make("mpistrategy-x-0", 700);

  const std::vector<std::string> removed =
      RemoveAbandonedShmSegments(dir_, 600);

  EXPECT_EQ(removed, std::vector<std::string>{abandoned});
  EXPECT_FALSE(Exists(abandoned));
  EXPECT_TRUE(Exists(young)) << "its creator may be in another PID namespace";
  EXPECT_TRUE(Exists(live));
  EXPECT_TRUE(Exists(foreign));
  EXPECT_TRUE(Exists(no_pid));
}

TEST_F(ShmSegmentsTest, MissingDirectoryRemovesNothing) {
  EXPECT_TRUE(RemoveAbandonedShmSegments(dir_ + "/absent", 0).empty());
}

}  // namespace
}  // namespace mpistrategy
