#!/bin/sh
echo "bazel coverage is not supported with the offline Bazel 4 stubs" >&2
exit 1
