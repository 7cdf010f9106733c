@echo on
:: Builds flash-attn into %PREFIX% on Windows: the CPU variant only (recipe.yaml skips the CUDA
:: variants outside Linux). The CPU-only CMake project compiles nothing (CMakeLists.txt), so no
:: Visual Studio is needed; Ninja (a build requirement) is the generator, because scikit-build-core
:: would otherwise ask CMake for its Windows default, a Visual Studio generator. build.sh is the
:: Linux/macOS twin.
setlocal EnableExtensions

if defined cuda_compiler_version if /i not "%cuda_compiler_version%"=="None" (
    echo flash-attn: CUDA variants are built on Linux only, not with cuda_compiler_version=%cuda_compiler_version% 1>&2
    exit 1
)

set "FLASH_ATTN_CPU_ONLY=1"
set "FLASH_ATTN_ENABLE_CUDA=OFF"
set "CMAKE_GENERATOR=Ninja"

%PYTHON% -m pip install . -vv --no-deps --no-build-isolation
if errorlevel 1 exit 1

:: pip records the temporary source folder here: an absolute build path, and of no use in a conda package.
for /d %%D in ("%SP_DIR%\flash_attn-*.dist-info") do (
    if exist "%%D\direct_url.json" del /f /q "%%D\direct_url.json"
    if errorlevel 1 exit 1
)
