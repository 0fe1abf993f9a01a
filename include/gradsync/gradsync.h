// defines: the umbrella header: everything a gradsync user needs.
#pragma once
#include "gradsync/accumulate.h"
#include "gradsync/bucket.h"
#include "gradsync/collectives.h"
#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/launch_env.h"
#include "gradsync/reducer.h"
#include "gradsync/reduction.h"
#include "gradsync/rendezvous.h"
#include "gradsync/runtime.h"
#include "gradsync/sampler.h"
#include "gradsync/state_dict.h"
