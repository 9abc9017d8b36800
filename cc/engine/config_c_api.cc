// C ABI of mpistrategy/_config.so, the TF-free library through which
// mpistrategy.Options (mpistrategy/options.py, ctypes) validates its values
// before anything starts: no TensorFlow and no MPI is loaded, so the
// launcher can call it too.  mpistrategy_init (cc/kernels/c_api.cc) runs the
// same ParseAndValidateConfig, so both report the same messages.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>

#include "cc/common/common.h"
#include "cc/engine/config.h"

extern "C" {

// Parses and range-checks `config_length` bytes of "key=value" entries, each
// ended by a NUL byte (the text mpistrategy_init takes; see
// mpistrategy::ParseConfig).  Returns 0 when every value is valid, else a
// StatusCode (cc/common/common.h; 3 = InvalidArgument) with the message
// copied, NUL-terminated and truncated to error_len bytes, to error_buf.
int mpistrategy_validate_config(const char* config_text, size_t config_length,
                                char* error_buf, int error_len) {
  mpistrategy::EngineConfig config;
  const mpistrategy::Status status =
      mpistrategy::ParseAndValidateConfig(config_text, config_length, &config);
  if (error_buf != nullptr && error_len > 0) {
    const std::string& message = status.message();
    const size_t n =
        std::min(message.size(), static_cast<size_t>(error_len) - 1);
    std::memcpy(error_buf, message.data(), n);
    error_buf[n] = '\0';
  }
  return static_cast<int>(status.code());
}

}  // extern "C"
