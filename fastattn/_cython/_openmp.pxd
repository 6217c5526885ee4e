# The OpenMP runtime functions, or serial stand-ins when built without OpenMP.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define FASTATTN_OPENMP 1
    #else
    #define FASTATTN_OPENMP 0
    static inline int omp_get_max_threads(void) { return 1; }
    static inline void omp_set_num_threads(int n) { (void) n; }
    #endif
    """
    const int FASTATTN_OPENMP
    int omp_get_max_threads() nogil
    void omp_set_num_threads(int n) nogil
