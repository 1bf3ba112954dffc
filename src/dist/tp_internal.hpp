// The sharded layer's insides shared with its C facade (c_api_tp.cpp).
#pragma once

#include <mpi.h>

#include "mha/error.hpp"

namespace mha::tp_detail {

// Takes this rank's part in a collective TpLayer construction that it cannot make (its C arguments
// failed their checks): the same MPI calls as the constructor, as a failing rank, so every rank's
// construction fails with e rather than waits. Throws the agreed error.
[[noreturn]] void create_failed(MPI_Comm comm, const Error &e);

} // namespace mha::tp_detail
