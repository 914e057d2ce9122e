// A loopback TCP port for a test to give a server it starts, or to name as
// an address nothing listens on.
#ifndef TE_TESTS_PORTS_H_
#define TE_TESTS_PORTS_H_

namespace te::testing {

// A port on 127.0.0.1 that the kernel picked as free a moment ago and that
// nothing listens on now (another process could take it in between); -1 if
// no socket could be bound.
int FreeLoopbackPort();

}  // namespace te::testing

#endif  // TE_TESTS_PORTS_H_
