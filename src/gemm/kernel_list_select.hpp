// Expands the lines of kernel_list.inc that belong to the ISA being compiled. The includer
// defines MHA_ISA_TAG (avx2 or avx512) and MHA_EMIT_KERNEL(name, mr, nv), which is expanded once
// per kernel of that ISA with its name ("avx512_14x32") as a string literal.
#define MHA_STR2(x) #x
#define MHA_STR(x) MHA_STR2(x)
#define MHA_NR_avx2(nv) MHA_NR_avx2_##nv
#define MHA_NR_avx512(nv) MHA_NR_avx512_##nv
#define MHA_NR_avx2_1 8
#define MHA_NR_avx2_2 16
#define MHA_NR_avx2_3 24
#define MHA_NR_avx512_1 16
#define MHA_NR_avx512_2 32
#define MHA_NR_avx512_3 48
#define MHA_NR_avx512_4 64
#define MHA_KEEP(isa, mr, nv) MHA_EMIT_KERNEL(#isa "_" #mr "x" MHA_STR(MHA_NR_##isa(nv)), mr, nv)
#define MHA_SKIP(isa, mr, nv)
#define MHA_SELECT_avx2_avx2 MHA_KEEP
#define MHA_SELECT_avx512_avx512 MHA_KEEP
#define MHA_SELECT_avx2_avx512 MHA_SKIP
#define MHA_SELECT_avx512_avx2 MHA_SKIP
#define MHA_SELECT3(tag, isa) MHA_SELECT_##tag##_##isa
#define MHA_SELECT2(tag, isa) MHA_SELECT3(tag, isa)
#define MHA_SGEMM_UKERNEL(isa, mr, nv) MHA_SELECT2(MHA_ISA_TAG, isa)(isa, mr, nv)
#include "gemm/kernel_list.inc"
#undef MHA_SGEMM_UKERNEL
